"""The first pull of the image on each node group, and the waits sized from it: Kueue's waitForPodsReady and
`cluster up`'s waits for the head and the workers. Pure.

The pull is estimate's model (estimate/timing.py `image_pull_s`) on each group's pull path: the image's size
(catalog/platform.yaml `images`), the node's network, and whether nodeadm pulls in parallel onto a gp3 volume
(render/eksctl.py). A wait allows `headroom` times the modelled pull plus Ray's start (catalog/scheduling.yaml
`pods_ready`), so a pull slower than the model by that factor still finishes inside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainlift import catalog
from trainlift.catalog.lookup import image_entry, load_data, pinned_image
from trainlift.config.cluster import ClusterSpec
from trainlift.estimate.timing import PullPath, image_pull_s
from trainlift.render.eksctl import PARALLEL_PULL_THROUGHPUT, SYSTEM_GROUP, pulls_in_parallel

MIB = 2**20
# EBS user guide, "General Purpose SSD volumes": gp3's baseline throughput, 125 MiB/s (eksctl's default volume type);
# a group that pulls in parallel gets PARALLEL_PULL_THROUGHPUT instead (render/eksctl.py).
GP3_BASELINE_MIB_S = 125


@dataclass(frozen=True)
class GroupPull:
    group: str
    instance_type: str
    seconds: float


@dataclass(frozen=True)
class ColdStart:
    """The image's modelled first pull on each group, and the waits that allow for it."""

    image: str
    image_gb: float
    size_known: bool  # False: the catalog does not size this image, so it is taken to be as large as the DLC
    head: GroupPull
    workers: tuple[GroupPull, ...]
    headroom: float
    ray_start_s: int

    def _wait(self, pull_s: float) -> int:
        return math.ceil(pull_s * self.headroom + self.ray_start_s)

    @property
    def head_wait_s(self) -> int:
        """How long `cluster up` waits for the Ray head pod to be Ready."""
        return self._wait(self.head.seconds)

    @property
    def workers_wait_s(self) -> int:
        """How long `cluster up` waits for every Ray worker pod to run."""
        return self._wait(max((w.seconds for w in self.workers), default=0.0))

    @property
    def pods_ready_timeout_m(self) -> int:
        """Kueue's waitForPodsReady timeout: every pod of a workload Ready, in whole minutes."""
        return math.ceil(max(self.head_wait_s, self.workers_wait_s) / 60)

    def lines(self) -> list[str]:
        """What render and `cluster up` print."""
        size = f"{self.image_gb:g} GB" + ("" if self.size_known else " (not in the catalog: taken as the DLC's size)")
        pulls = ", ".join(f"{_clock(p.seconds)} on {p.instance_type} ({p.group})" for p in (self.head, *self.workers))
        return [f"image {self.image}, {size}: first pull modelled at {pulls}",
                f"cluster up waits {_clock(self.head_wait_s)} for the head, {_clock(self.workers_wait_s)} for the "
                f"workers; Kueue waitForPodsReady {self.pods_ready_timeout_m}m ({self.headroom:g}x the pull + "
                f"{_clock(self.ray_start_s)} for Ray's start)"]


def _clock(seconds: float) -> str:
    whole = math.ceil(seconds)
    return f"{whole // 60}m{whole % 60:02d}s"


def image_size_gb(image: str) -> tuple[float, bool]:
    """(the image's size unpacked in GB, whether the catalog knows it): a floating tag by the release it stands for;
    an image the catalog does not size is taken to be the DLC's size."""
    entry = image_entry(pinned_image(image) or image) or {}
    if "size_gb" in entry:
        return float(entry["size_gb"]), True
    return float(catalog.platform()["defaults"]["image_size_gb"]), False


def pull_path(spec: ClusterSpec, instance_type: str) -> PullPath:
    """How a node of this type pulls: the measured unpack rate, its network, and the disk its layers go to (the
    instance store's RAID0 is left out: it is not the narrower part)."""
    anchor = load_data("scheduling.yaml")["pods_ready"]["pull_anchor"]
    profile = catalog.lookup(instance_type)
    disk = None
    if not profile.local_nvme_gb:
        mib_s = PARALLEL_PULL_THROUGHPUT if pulls_in_parallel(spec, profile) else GP3_BASELINE_MIB_S
        disk = mib_s * MIB / 1e9
    return PullPath(anchor["gb"] / anchor["seconds"], profile.network_gbps, disk)


def cold_start(spec: ClusterSpec) -> ColdStart:
    ready = load_data("scheduling.yaml")["pods_ready"]
    image = spec.image.uri
    gb, known = image_size_gb(image)

    def pull(group: str, instance_type: str) -> GroupPull:
        return GroupPull(group, instance_type, image_pull_s(gb, pull_path(spec, instance_type)))

    return ColdStart(pinned_image(image) or image, gb, known, pull(SYSTEM_GROUP, spec.system.instance_type),
                     tuple(pull(w.name, w.instance_type) for w in spec.workers), float(ready["headroom"]),
                     int(ready["ray_start_s"]))
