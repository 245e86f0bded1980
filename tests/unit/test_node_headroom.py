"""Huge pages, ephemeral storage and headroom as EKS AL2023 nodes really have them, on paper and on the nodes.

No EC2 instance, AMI or API server runs here. The figures are those of the sources catalog/scheduling.yaml and
catalog/instances.yaml cite: nodeadm's kubelet configuration and its instance-info.jsonl (amazon-eks-ami v20260724;
the lines for the types below are recorded here as the file has them), efa-config's huge page sizing as the EFA
team's check computes it, the VPC CNI add-on's manifest (aws-node and its network policy agent). The nodes are
`kubectl get nodes -o json` objects in kubectl's shape."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from trainlift import catalog
from trainlift.config.cluster import cluster_spec_from_yaml
from trainlift.ops.kube import parse_nodes
from trainlift.ops.plan_kube import live_fit_problems
from trainlift.render import fit
from trainlift.render.raycluster import raycluster_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# awslabs/amazon-eks-ami nodeadm/internal/kubelet/instance-info.jsonl@v20260724, as recorded.
INSTANCE_INFO = """\
{"instanceType":"g5.12xlarge","defaultMaxENIs":15,"ipv4AddressesPerInterface":50}
{"instanceType":"g6e.48xlarge","defaultMaxENIs":10,"ipv4AddressesPerInterface":50}
{"instanceType":"p4d.24xlarge","defaultMaxENIs":15,"ipv4AddressesPerInterface":50}
{"instanceType":"p5en.48xlarge","defaultMaxENIs":4,"ipv4AddressesPerInterface":50}
{"instanceType":"m7i.xlarge","defaultMaxENIs":4,"ipv4AddressesPerInterface":15}
{"instanceType":"m7i.4xlarge","defaultMaxENIs":8,"ipv4AddressesPerInterface":30}
"""
WORKER = "ip-10-0-2-11.us-east-2.compute.internal"


def example(name: str):
    return cluster_spec_from_yaml((EXAMPLES / name).read_text())


def test_max_pods_and_kube_reserved_memory_follow_nodeadms_instance_info():
    """maxPods = default ENIs x (IPv4 per ENI - 1) + 2 (eni_max_pods.go); kube-reserved memory 11 MiB a pod + 255."""
    for line in INSTANCE_INFO.splitlines():
        info = json.loads(line)
        pods = info["defaultMaxENIs"] * (info["ipv4AddressesPerInterface"] - 1) + 2
        profile = catalog.lookup(info["instanceType"])
        assert profile.max_pods == pods, info["instanceType"]
        reserved = 11 * pods + 255
        assert fit.allocatable(profile).mem_mib == math.floor(profile.memory_mib * 0.925) - reserved - 100
    # A g5.12xlarge runs 737 pods, not the kubelet's default 110: 6,897 MiB more kept from pods.
    assert fit.allocatable(catalog.lookup("g5.12xlarge")).mem_mib == 181862 - 8362 - 100


def test_the_huge_page_pool_is_efa_configs_and_only_where_an_efa_interface_is_attached():
    """efa-config reserves 110 MiB x vCPUs of 2 MiB pages (+1 page) at boot when an EFA device is present: on a
    p5.48xlarge 10,561 pages, 21,122 MiB, out of the node's memory. A socket-fabric node has none."""
    efa = example("cluster-p5.yaml")
    [group] = [w.name for w in efa.workers]
    with_efa = fit.node_allocatable(efa, group)
    socket = efa.model_copy(update={"fabric": "socket"})
    without = fit.node_allocatable(socket, group)
    assert with_efa.hugepages_mib == (55 * 192 + 1) * 2 == 21122
    assert without.hugepages_mib == 0
    assert without.mem_mib - with_efa.mem_mib == 21122
    # The worker pod's 5120Mi request comes out of that pool: it fits, and render places it.
    [_, worker] = fit.placements(efa, raycluster_spec(efa))
    assert worker.need.hugepages_mib == 5120 and worker.left.hugepages_mib == 21122 and worker.fits


def test_aws_node_counts_its_network_policy_agent():
    """The rendered NetworkPolicy is enforced by aws-node's aws-eks-nodeagent container: 25m beside the CNI's 25m."""
    spec = example("cluster-reference.yaml")
    for system in (True, False):
        assert fit.landed_first(spec, system)["aws-node"] == fit.Amount(50, 0)


def test_the_system_node_keeps_room_for_one_more_daemonset():
    """On the reference's m7i.xlarge: allocatable 3,920m less kube-proxy 100m, aws-node 50m, KubeRay 100m, CoreDNS
    2 x 100m, metrics-server 100m, Kueue 500m and the submitter 200m leaves 2,670m; the head must leave 100m of it."""
    spec = example("cluster-reference.yaml")
    head = raycluster_spec(spec)["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    taken = 100 + 50 + 100 + 200 + 100 + 500 + 200
    assert fit.allocatable(catalog.lookup("m7i.xlarge")).cpu_m - taken - fit.cpu_m(head["cpu"]) >= 100


def _nodes(hugepages: str, ephemeral: str) -> str:
    system = {"metadata": {"name": "ip-10-0-1-10.us-east-2.compute.internal",
                           "labels": {"role": "system", "node.kubernetes.io/instance-type": "m7i.xlarge"}},
              "status": {"allocatable": {"cpu": "3920m", "memory": "14961564Ki", "ephemeral-storage": "76224326324",
                                         "hugepages-2Mi": "0", "pods": "58"},
                         "conditions": [{"type": "Ready", "status": "True"}]}}
    workers = [{"metadata": {"name": WORKER.replace("11", str(i)),
                             "labels": {"role": "gpu-worker", "trainlift.io/worker-group": "gpu-workers",
                                        "node.kubernetes.io/instance-type": "g6.12xlarge"}},
                "status": {"allocatable": {"cpu": "47810m", "memory": "186478516Ki", "nvidia.com/gpu": "4",
                                           "vpc.amazonaws.com/efa": "1", "hugepages-2Mi": hugepages,
                                           "ephemeral-storage": ephemeral, "pods": "234"},
                           "conditions": [{"type": "Ready", "status": "True"}]}} for i in (11, 12)]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [system, *workers]})


RAID0 = "3366006258176"  # the 3,760 GB NVMe array less 0.5% for the filesystem, kube-reserved 1Gi, 10% eviction


def test_nodes_as_render_expects_them_pass_the_live_check():
    assert live_fit_problems(example("cluster-reference.yaml"), parse_nodes(_nodes("5282Mi", RAID0))) == []


def test_a_worker_without_the_huge_page_pool_is_named_with_the_resource_expected_and_found():
    """A node whose EFA configuration did not run (an AMI without efa-config, a custom launch template) reports no
    huge pages: the worker pod's 5120Mi would leave it Pending."""
    [problem] = live_fit_problems(example("cluster-reference.yaml"), parse_nodes(_nodes("0", RAID0)))
    assert problem.startswith("the ray-worker (gpu-workers) pod fits 0 of 2 g6.12xlarge node(s) as they are: ")
    assert (f"node {WORKER} hugepages-2Mi: allocatable 0 MiB, render expected 5282 MiB; the pod requests 5120 MiB "
            "and 0 MiB is left after what lands there first") in problem


def test_a_worker_whose_kubelet_is_on_the_root_volume_is_named_with_its_ephemeral_storage():
    """Without the instance-store RAID0 under the kubelet, the 200 GiB root volume holds the pod's emptyDir."""
    root_volume = str(200 * 2 ** 30 - 2 ** 30 - 20 * 2 ** 30)
    [problem] = live_fit_problems(example("cluster-reference.yaml"), parse_nodes(_nodes("5282Mi", root_volume)))
    assert (f"node {WORKER} ephemeral-storage: allocatable 183296 MiB, render expected 3226209 MiB; the pod "
            "requests 3165184 MiB") in problem


def test_a_system_type_without_room_gives_way_to_the_next_size_with_its_price(monkeypatch):
    """With a 2.5-CPU agent on the system group the m7i.xlarge leaves less than the smallest Ray head (1 CPU, 2 GiB)
    after the margin: render takes the m7i.2xlarge and says why and what it costs."""
    spec = example("cluster-reference.yaml")
    assert fit.with_system_headroom(spec) == (spec, "")
    data = yaml.safe_load(yaml.safe_dump(fit._data()))
    data["system_node"]["security-agent"] = {"cpu": "2500m", "memory": "1Gi"}
    monkeypatch.setattr(fit, "_data", lambda: data)
    sized, note = fit.with_system_headroom(spec)
    assert sized.system.instance_type == "m7i.2xlarge" and spec.system.instance_type == "m7i.xlarge"
    assert note == ("system node m7i.xlarge leaves 70m CPU, 11134 MiB for the Ray head after its DaemonSets, add-ons "
                    "and a margin for one more DaemonSet; the head needs at least 1000m CPU, 2048 MiB: rendered "
                    "m7i.2xlarge instead ($0.4032/h a node against $0.2016/h on demand in us-east-2: +$0.2016/h for "
                    "1 node(s))")
    [head, _] = fit.placements(sized, raycluster_spec(sized))
    assert head.instance_type == "m7i.2xlarge" and head.fits
