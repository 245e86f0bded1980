"""Check rendered manifests against the real schemas before anything is written.

eksctl ClusterConfig: eksctl's JSON schema, and each node group's NodeConfig nodeadm's CRD. KubeRay (RayCluster,
RayJob), Kueue (ClusterQueue, LocalQueue, ResourceFlavor, Topology) and Volcano (Queue, PodGroup) objects: their
CRDs' openAPIV3Schema at the version rendered, plus a walk that flags fields the schema does not know (the API server
would prune them silently).
Core objects: kubernetes-validate.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable

import jsonschema
import yaml

EKSCTL_SCHEMA = "eksctl-v0.230.0-clusterconfig.schema.json"
# kind -> (API group, CRD file)
CRDS = {
    "RayCluster": ("ray.io", "kuberay-v1.7.0-ray.io_rayclusters.yaml"),
    "RayJob": ("ray.io", "kuberay-v1.7.0-ray.io_rayjobs.yaml"),
    "ClusterQueue": ("kueue.x-k8s.io", "kueue-v0.19.2-kueue.x-k8s.io_clusterqueues.yaml"),
    "LocalQueue": ("kueue.x-k8s.io", "kueue-v0.19.2-kueue.x-k8s.io_localqueues.yaml"),
    "ResourceFlavor": ("kueue.x-k8s.io", "kueue-v0.19.2-kueue.x-k8s.io_resourceflavors.yaml"),
    "Topology": ("kueue.x-k8s.io", "kueue-v0.19.2-kueue.x-k8s.io_topologies.yaml"),
    "Queue": ("scheduling.volcano.sh", "volcano-v1.15.1-scheduling.volcano.sh_queues.yaml"),
    "PodGroup": ("scheduling.volcano.sh", "volcano-v1.15.1-scheduling.volcano.sh_podgroups.yaml"),
}
NODEADM_GROUP, NODEADM_CRD = "node.eks.aws", "nodeadm-v20260724-node.eks.aws_nodeconfigs.yaml"
# The CRD types featureGates as a map of booleans; the names are nodeadm's Feature enum
# (api/v1alpha1/nodeconfig_types.go).
NODEADM_FEATURE_GATES = ("InstanceIdNodeName", "FastImagePull")
CRD_FILES = {kind: file for kind, (_, file) in CRDS.items()}
OBJECT_META_KEYS = {"name", "namespace", "labels", "annotations"}
MAX_MESSAGE = 160


def _schema_text(name: str) -> str:
    return resources.files("trainlift.render").joinpath("schemas", name).read_text()


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top)"


def _short(message: str) -> str:
    message = message.splitlines()[0] if message else message
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


@lru_cache(maxsize=1)
def _eksctl_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(_schema_text(EKSCTL_SCHEMA)))


@lru_cache(maxsize=None)
def crd_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    crd = yaml.load(_schema_text(CRD_FILES[kind]), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{kind} has no version {version}")


@lru_cache(maxsize=None)
def _crd_validator(kind: str, version: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(crd_schema(kind, version))


def _schema_errors(validator: jsonschema.Draft7Validator, obj: Any) -> list[str]:
    errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_path(e.absolute_path)}: {_short(e.message)}" for e in errors]


def eksctl_problems(config: dict[str, Any]) -> list[str]:
    """eksctl's schema, and each node group's NodeConfig (overrideBootstrapCommand) against nodeadm's CRD."""
    problems = _schema_errors(_eksctl_validator(), config)
    for i, group in enumerate(config.get("managedNodeGroups") or []):
        if isinstance(group, dict) and isinstance(group.get("overrideBootstrapCommand"), str):
            problems += [f"managedNodeGroups[{i}].overrideBootstrapCommand: {p}"
                         for p in node_config_problems(group["overrideBootstrapCommand"])]
    return problems


def node_config_problems(text: str) -> list[str]:
    """A nodeadm NodeConfig (the part a managed node group adds to EKS's own) against nodeadm's CRD."""
    config = yaml.safe_load(text)
    if not isinstance(config, dict) or config.get("kind") != "NodeConfig":
        return ["not a nodeadm NodeConfig (kind: NodeConfig)"]
    if config.get("apiVersion") != f"{NODEADM_GROUP}/v1alpha1":
        return [f"apiVersion: {config.get('apiVersion')!r} is not {NODEADM_GROUP}/v1alpha1"]
    validator = _node_config_validator()
    gates = (config.get("spec") or {}).get("featureGates") or {}
    return (_schema_errors(validator, config) + unknown_fields(config, validator.schema)
            + [f"spec.featureGates.{g}: not one of nodeadm's {list(NODEADM_FEATURE_GATES)}"
               for g in gates if g not in NODEADM_FEATURE_GATES])


@lru_cache(maxsize=1)
def _node_config_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(_schema_text(NODEADM_CRD))
    return jsonschema.Draft7Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def unknown_fields(node: Any, schema: dict[str, Any], path: tuple[Any, ...] = ()) -> list[str]:
    """Paths in `node` that `schema` does not declare, honouring x-kubernetes-preserve-unknown-fields."""
    found: list[str] = []
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(node, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], path + (key,))
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, path + (key,))
            elif not (preserve or extra is True):
                found.append(f"{_path(path + (key,))}: unknown field (the API server would drop it)")
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(node):
            found += unknown_fields(item, schema["items"], path + (i,))
    return found


def _metadata_problems(meta: Any) -> list[str]:
    if not isinstance(meta, dict) or not meta.get("name"):
        return ["metadata.name: required"]
    return [f"metadata.{k}: not checked by this validator; use one of {sorted(OBJECT_META_KEYS)}"
            for k in meta if k not in OBJECT_META_KEYS]


def crd_problems(obj: dict[str, Any]) -> list[str]:
    kind = obj.get("kind")
    if kind not in CRDS:
        return [f"kind: {kind!r} is not a KubeRay, Kueue or Volcano kind trainlift validates"]
    expected_group = CRDS[kind][0]
    group, _, version = str(obj.get("apiVersion", "")).partition("/")
    if group != expected_group:
        return [f"apiVersion: {obj.get('apiVersion')!r} is not {expected_group}/<version>"]
    try:
        schema = crd_schema(kind, version)
    except KeyError:
        return [f"apiVersion: {kind} has no version {version!r}"]
    problems = _schema_errors(_crd_validator(kind, version), obj)
    problems += _metadata_problems(obj.get("metadata"))
    body = {k: v for k, v in obj.items() if k != "metadata"}
    return problems + unknown_fields(body, {**schema, "properties": {
        k: v for k, v in schema["properties"].items() if k != "metadata"}})


def _schema_version(kubernetes_version: str) -> str:
    """The newest schema kubernetes-validate ships that is not newer than the cluster's version."""
    import kubernetes_validate  # the user's side only: a node (the image) has no kubernetes-validate

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    versions = sorted(kubernetes_validate.utils.all_versions(), key=key)
    older = [v for v in versions if key(v) <= key(kubernetes_version)]
    return (older or versions[:1])[-1]


def core_problems(obj: dict[str, Any], kubernetes_version: str) -> list[str]:
    """A core Kubernetes object, strictly (unknown fields are errors), against the cluster's version."""
    import kubernetes_validate

    version = _schema_version(kubernetes_version)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{_path(exc.absolute_path)}: {_short(exc.message)}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"kind: no schema for {obj.get('apiVersion')}/{obj.get('kind')} in Kubernetes {version}"]
    return []


def values_problems(values: dict[str, Any], kubernetes_version: str) -> list[str]:
    """Helm values that are pod-spec fragments (nodeSelector, tolerations), checked as a Pod's."""
    pod_spec = {k: values[k] for k in ("nodeSelector", "tolerations", "affinity") if k in values}
    if not pod_spec:
        return []
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "values"},
        "spec": {"containers": [{"name": "c", "image": "i"}], **pod_spec},
    }
    return [p.replace("spec.", "", 1) for p in core_problems(pod, kubernetes_version)]
