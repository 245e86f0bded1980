"""The Kubernetes side of `plan_up`: device plugins, KubeRay, namespace, secrets, network policy, service account,
the RayCluster, and the waits until Ray runs on every GPU node. Pure.

One owner per device plugin. NVIDIA: trainlift's pinned Helm release; `eksctl create nodegroup` is run
with --install-nvidia-plugin=false, and eksctl's DaemonSet, if an older run left one, is deleted.
EFA: also the Helm release (it tolerates the worker taints and lists this cluster's instance types),
but eksctl writes a DaemonSet of the same name for every efaEnabled node group with no switch to stop
it (eksctl pkg/eks/tasks.go, ClusterTasksForNodeGroups); Helm adopts that DaemonSet at apply time.
"""

from __future__ import annotations

from typing import Any

from trainlift.config.cluster import ClusterSpec
from trainlift.ops import eksctl, kube
from trainlift.ops.steps import DASHBOARD_PORT, FORWARDED_DASHBOARD_PORT, Files, Observed, Op, Step
from trainlift.ops.steps import run_op as _run
from trainlift.ops.steps import waiting_for_block
from trainlift.ops.steps import wait_op as _wait
from trainlift.render import fit
from trainlift.render.eksctl import SYSTEM_LABELS, WORKER_GROUP_LABEL
from trainlift.render.fit import Amount
from trainlift.ops.pins import crds_folder_charts
from trainlift.render.cold_start import cold_start
from trainlift.render.helm import chart_archive, helm_install_args
from trainlift.render.network_policy import NETWORK_POLICY_PATH, POLICY_NAME
from trainlift.render.queues import queue_object_path, queue_objects
from trainlift.render.raycluster import EFA_RESOURCE, GPU_RESOURCE, raycluster_spec

PLUGIN_NAMESPACE = "kube-system"
# eksctl's own NVIDIA DaemonSet (eksctl pkg/addons/assets/nvidia-device-plugin.yaml).
EKSCTL_NVIDIA_DAEMONSET = "nvidia-device-plugin-daemonset"


def _release_state(seen: Observed, release: dict[str, Any]) -> tuple[str, bool]:
    """(what was seen, whether the pinned chart is deployed)."""
    if seen.absent:
        return "absent (new cluster)", False
    if seen.releases is None:
        return seen.why("helm"), False
    found = seen.releases.get(release["name"])
    if found is None:
        return "not installed", False
    if found.status == "deployed" and found.version == release["version"]:
        return f"deployed ({found.version})", True
    return f"{found.status} ({found.version or found.chart}), pinned {release['version']}", False


def _helm_op(files: Files, release: dict[str, Any], wait: bool) -> Op:
    """From the chart archive the pins step pulled and checked (ops/charts.py), not from the repository again."""
    values = files.path(f"helm/{release['name']}.values.yaml")
    archive = files.path(f"charts/{chart_archive(release)}")
    return _run(kube.helm_install(files.kubeconfig, helm_install_args(release, values, archive), wait))


def nvidia_up(seen: Observed, files: Files, release: dict[str, Any]) -> Step:
    """The one NVIDIA plugin: eksctl's is never installed, and removed if an older run left it."""
    title = f"Helm release {release['name']} {release['version']} ({release['namespace']})"
    observed, current = _release_state(seen, release)
    ops = [_helm_op(files, release, wait=False)]
    eksctl_ds = not seen.absent and (seen.daemonsets is None or EKSCTL_NVIDIA_DAEMONSET in seen.daemonsets)
    if eksctl_ds:
        ops.insert(0, _run(kube.kubectl(files.kubeconfig, "-n", PLUGIN_NAMESPACE, "delete", "daemonset",
                                        EKSCTL_NVIDIA_DAEMONSET, "--ignore-not-found")))
        if seen.daemonsets is not None:
            observed += f"; eksctl's {EKSCTL_NVIDIA_DAEMONSET} runs too"
    if current and not eksctl_ds:
        return Step(f"helm/{release['name']}", title, observed, "nothing")
    return Step(f"helm/{release['name']}", title, observed, "install", tuple(ops),
                note=f"a second NVIDIA plugin ({EKSCTL_NVIDIA_DAEMONSET}, eksctl's) is removed" if eksctl_ds else "")


def efa_up(seen: Observed, files: Files, release: dict[str, Any], creates_group: bool) -> Step:
    """Installed again after any node group is created: eksctl rewrites the DaemonSet then."""
    name = release["name"]
    title = f"Helm release {name} {release['version']} ({release['namespace']})"
    observed, current = _release_state(seen, release)
    owner = None if seen.daemonsets is None else seen.daemonsets.get(name)
    if owner is not None and owner != name:
        observed += "; its DaemonSet was written by eksctl"
    if current and owner == name and not creates_group:
        return Step(f"helm/{name}", title, observed, "nothing")
    adopt = Op("adopt", tuple(kube.helm_adopt(files.kubeconfig, "daemonset", name, PLUGIN_NAMESPACE, name)),
               until=f"daemonset/{PLUGIN_NAMESPACE}/{name}={name}")
    note = "after a node group is created: eksctl rewrites the DaemonSet" if creates_group and current else ""
    return Step(f"helm/{name}", title, observed, "install", (adopt, _helm_op(files, release, wait=False)), note=note)


def release_up(seen: Observed, files: Files, release: dict[str, Any]) -> Step:
    """A pinned release installed with --wait: KubeRay, and the scheduler whose webhooks must answer before
    anything queued is applied."""
    title = f"Helm release {release['name']} {release['version']} ({release['namespace']})"
    observed, current = _release_state(seen, release)
    if current:
        return Step(f"helm/{release['name']}", title, observed, "nothing")
    if release["name"] not in crds_folder_charts():
        return Step(f"helm/{release['name']}", title, observed, "install", (_helm_op(files, release, wait=True),))
    return Step(f"helm/{release['name']}", title, observed, "install",
                (_crd_op(files, release), _helm_op(files, release, wait=True)),
                note="its CRDs are applied server-side first: Helm never upgrades a chart's crds/ folder")


def _crd_op(files: Files, release: dict[str, Any]) -> Op:
    """The chart's CRDs at its pinned version, applied server-side (new fields kept on an upgrade)."""
    into = files.path(f"charts/{release['name']}-{release['version']}-crds.yaml")
    show = ("helm", "show", "crds", files.path(f"charts/{chart_archive(release)}"))
    return Op("crds", show, until=into,
              then=tuple(kube.kubectl(files.kubeconfig, "apply", "--server-side", "--force-conflicts", "-f", into)))


kuberay_up = release_up


def queues_up(spec: ClusterSpec, seen: Observed, files: Files) -> list[Step]:
    """The scheduler's queue objects (server-side apply: unchanged ones are a no-op); none with scheduler: none."""
    objects = queue_objects(spec)
    if not objects:
        return []
    ops = tuple(_run(kube.apply(files.kubeconfig, files.path(queue_object_path(i, obj))))
                for i, obj in enumerate(objects))
    kinds = ", ".join(f"{obj['kind']} {obj['metadata']['name']}" for obj in objects)
    observed = "absent (new cluster)" if seen.absent else "applied on every up (server-side apply: unchanged, a no-op)"
    return [Step("queues", f"{spec.scheduler} queues: {kinds}", observed, "apply", ops)]


def namespace_and_secrets(spec: ClusterSpec, seen: Observed, files: Files) -> list[Step]:
    """Before any node group: a required Secret is waited for while only the control plane exists."""
    steps = []
    ns_title = f"namespace {spec.namespace}"
    if seen.namespace:
        steps.append(Step("namespace", ns_title, "exists", "nothing"))
    else:
        observed = "absent" if seen.absent or seen.namespace is False else seen.why("kubernetes")
        steps.append(Step("namespace", ns_title, observed, "apply",
                          (_run(kube.apply(files.kubeconfig, files.path("k8s/00-namespace.yaml"))),)))
    for ref in spec.secrets:
        title = f"secret {ref.secret} (key {ref.key} -> {ref.env})"
        create = (f"kubectl --kubeconfig {files.kubeconfig} -n {spec.namespace} create secret generic "
                  f"{ref.secret} --from-literal={ref.key}=...")
        if seen.secrets is not None and ref.secret in seen.secrets:
            steps.append(Step(f"secret/{ref.secret}", title, "exists", "nothing"))
        elif seen.secrets is None and not seen.absent:
            steps.append(Step(f"secret/{ref.secret}", title, seen.why("kubernetes"), "nothing", fix=create))
        elif ref.optional:
            steps.append(Step(f"secret/{ref.secret}", title, "absent (optional: pods start without it)", "nothing",
                              fix=create))
        else:
            steps.append(Step(f"secret/{ref.secret}", title, "absent", "wait",
                              (_wait(f"secret/{ref.secret}", timeout_s=1800),),
                              note="trainlift never handles secret values: create it yourself; no node group "
                                   "is created until it exists", fix=create))
    return steps + [network_policy_up(spec, seen, files)]


def network_policy_up(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    """Before any Ray pod exists: only pods of the namespace (and KubeRay's operator, on the dashboard) reach them."""
    observed = "absent (new cluster)" if seen.absent else "applied on every up (server-side apply: unchanged, a no-op)"
    return Step("network-policy", f"NetworkPolicy {spec.namespace}/{POLICY_NAME} (Ray pods: this namespace only)",
                observed, "apply", (_run(kube.apply(files.kubeconfig, files.path(NETWORK_POLICY_PATH))),))


def service_account_up(spec: ClusterSpec, seen: Observed, files: Files) -> list[Step]:
    s3 = spec.storage.s3 if spec.storage else None
    if s3 is None:
        return []
    title = f"service account {s3.service_account} (S3 checkpoints through IRSA)"
    exists = seen.service_accounts is not None and s3.service_account in seen.service_accounts
    if s3.role_arn:
        observed = "exists; applied again (a changed role ARN is updated)" if exists else (
            "absent" if seen.service_accounts is not None or seen.absent else seen.why("kubernetes"))
        return [Step("service-account", title, observed, "apply",
                     (_run(kube.apply(files.kubeconfig, files.path("k8s/10-serviceaccount.yaml"))),))]
    if exists:
        return [Step("service-account", title, "exists; its IAM policy is applied again (unchanged: no-op)", "apply",
                     (_run(eksctl.update_service_accounts(files.path("eksctl.yaml"))),))]
    observed = "absent" if seen.service_accounts is not None or seen.absent else seen.why("kubernetes")
    return [Step("service-account", title, observed, "create",
                 (_run(eksctl.create_service_accounts(files.path("eksctl.yaml"))),))]


def live_fit_problems(spec: ClusterSpec, nodes: tuple[kube.Node, ...] | list[kube.Node] | None) -> list[str]:
    """Render's scheduling check again, on the nodes' real allocatable where they have joined."""
    by_group: dict[str, list[tuple[str, Amount]]] = {}
    groups = {fit.SYSTEM, *(w.name for w in spec.workers)}
    for n in nodes or ():
        group = "system" if n.role == SYSTEM_LABELS["role"] else n.group
        if n.cpu_m and group in groups:
            # A resource the node does not report is not judged: taken as render expects it.
            expected = fit.node_allocatable(spec, group)
            found = Amount(n.cpu_m, n.mem_mib, expected.hugepages_mib if n.hugepages_mib is None else n.hugepages_mib,
                           expected.ephemeral_mib if n.ephemeral_mib is None else n.ephemeral_mib)
            by_group.setdefault(group, []).append((n.name, found))
    return fit.live_fit_problems(spec, fit.placements(spec, raycluster_spec(spec)), by_group)


FIT_OP = Op("fit", until="every Ray pod fits a node of its group, on the nodes' .status.allocatable")


def raycluster_up(spec: ClusterSpec, seen: Observed, files: Files) -> Step:
    title = f"RayCluster {spec.namespace}/{spec.name} (server-side apply)"
    rc = seen.raycluster
    if problems := live_fit_problems(spec, seen.nodes):
        return Step("raycluster", title, "the nodes' allocatable is smaller than render's figures", "blocked",
                    note="; ".join(problems), fix="choose a larger instance type, or lower the pod's requests "
                    "(then run up again); `kubectl describe node` shows allocatable and what runs there")
    apply_op = (FIT_OP, _run(kube.apply(files.kubeconfig, files.path("k8s/20-raycluster.yaml"))))
    if seen.absent or (rc is not None and not rc.exists):
        return Step("raycluster", title, "absent", "apply", apply_op)
    if rc is None:
        return Step("raycluster", title, seen.why("kubernetes"), "apply", apply_op)
    if rc.spec_hash == files.raycluster_hash:
        return Step("raycluster", title, f"exists, spec unchanged (state {rc.state or 'unknown'})", "nothing")
    delete = _run(kube.kubectl(files.kubeconfig, "-n", spec.namespace, "delete", "raycluster", spec.name,
                               "--ignore-not-found", "--wait=true", "--timeout=10m"))
    return Step("raycluster", title, "exists with a different spec", "replace", (delete, *apply_op),
                note="KubeRay keeps running pods on a spec change: the RayCluster is re-created; running Ray jobs stop")


def waits_up(spec: ClusterSpec, seen: Observed, files: Files, replaced: bool) -> list[Step]:
    """The head's and the workers' waits allow for the image's modelled first pull (render/cold_start.py)."""
    kc, ns, rc = files.kubeconfig, spec.namespace, seen.raycluster
    start = cold_start(spec)
    head_argv = kube.kubectl(kc, "-n", ns, "wait", "pod", "-l", kube.ray_selector(spec.name, "head"),
                             "--for=condition=Ready", f"--timeout={start.head_wait_s}s")
    known = rc is not None and not seen.absent and not replaced
    steps = [Step("wait/head", "Ray head pod Ready", "Ready" if known and rc.head_ready else "not Ready",
                  "nothing" if known and rc.head_ready else "wait",
                  () if known and rc.head_ready else (_wait("head-ready", head_argv, start.head_wait_s),),
                  note=f"up to {start.head_wait_s} s: {start.lines()[0]}")]
    expected = sum(w.count for w in spec.workers if waiting_for_block(w, seen) is None)
    running = rc.workers_running if known else 0
    worker_argv = kube.kubectl(kc, "-n", ns, "get", "pods", "-l", kube.ray_selector(spec.name, "worker"))
    steps.append(Step("wait/workers", f"{expected} Ray worker pods Running", f"{running} of {expected} Running",
                      "nothing" if running >= expected else "wait",
                      () if running >= expected else (_wait(f"workers-running={expected}", worker_argv,
                                                             start.workers_wait_s),),
                      note=f"up to {start.workers_wait_s} s ({start.headroom:g}x the modelled pull + Ray's start)"))
    for w in spec.workers:
        if (blocked := waiting_for_block(w, seen)) is not None:
            steps.append(Step(f"wait/nodes/{w.name}", f"each {w.name} node advertises its GPUs", blocked, "nothing", ()))
            continue
        gpus, efa = w.profile.gpus, (w.profile.efa_interfaces if spec.fabric == "efa" else 0)
        mine = [n for n in seen.nodes or () if n.group == w.name]
        good = [n for n in mine if n.ready and n.gpus >= gpus and n.efa >= efa]
        want = f"{gpus} {GPU_RESOURCE}" + (f" and {efa} {EFA_RESOURCE}" if efa else "")
        done = seen.nodes is not None and len(good) >= w.count
        argv = kube.kubectl(kc, "get", "nodes", "-l", f"{WORKER_GROUP_LABEL}={w.name}", "-o",
                            "custom-columns=NODE:.metadata.name,GPU:.status.allocatable.nvidia\\.com/gpu,"
                            "EFA:.status.allocatable.vpc\\.amazonaws\\.com/efa")
        observed = f"{len(good)} of {w.count} nodes advertise it" if seen.nodes is not None else (
            "no nodes yet" if seen.absent else seen.why("kubernetes"))
        steps.append(Step(f"wait/nodes/{w.name}", f"each {w.name} node advertises {want}", observed,
                          "nothing" if done else "wait", () if done else (_wait(f"nodes/{w.name}", argv, 1200),)))
    return steps


def doctor_op(spec: ClusterSpec, files: Files) -> Op:
    forward = kube.kubectl(files.kubeconfig, "-n", spec.namespace, "port-forward", f"svc/{spec.name}-head-svc",
                           f"{FORWARDED_DASHBOARD_PORT}:{DASHBOARD_PORT}")
    # Through the Jobs API: the probe runs on the head with the image's Ray and Python, not over Ray Client,
    # which refuses a laptop whose Ray or Python minor version differs from the image's.
    doctor = ["trainlift", "doctor", "--address", f"http://127.0.0.1:{FORWARDED_DASHBOARD_PORT}", "--expect-fabric",
              spec.fabric or "any"]
    if spec.storage and spec.storage.s3:  # every node's pods' role on the run storage (doctor/storage.py)
        doctor += ["--storage", spec.storage.s3.uri]
    return Op("doctor", tuple(doctor), background=tuple(forward), timeout_s=600)


