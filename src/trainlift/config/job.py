"""The job spec: what to fine-tune, on which data, for how long, where results go.

Loaded from YAML; unknown keys are errors; `--set a.b=c` overrides any field.
Relative paths are resolved against the directory the command runs in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from trainlift.config.data import DataSection
from trainlift.config.errors import field_path, first_error, unknown_key_suggestion
from trainlift.errors import SpecError
from trainlift.config.section import Section as _Section
from trainlift.config.spec_paths import relative_to_spec
from trainlift.redact import credential_problem, uri_credentials


class LoraSection(_Section):
    r: int = Field(16, gt=0, description="Rank of the adapter matrices.")
    alpha: float | None = Field(None, gt=0, description="Scaling numerator (the update is alpha/r * B @ A); default 2*r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Names of the linear layers to adapt (e.g. [q_proj, v_proj]); "
        "all-linear: every linear layer of the decoder blocks.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module, or use all-linear")
        return value

    @property
    def scaling_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.r


class ModelSection(_Section):
    path: str | None = Field(None, description="Local HF model directory, hub id or s3://bucket/prefix. Hub and S3 "
                             "models are fetched once per node (the indexed weight files, config and tokenizer) into "
                             "the node's model cache (TRAINLIFT_MODEL_CACHE, else <staging dir>/models); a local one "
                             "must be readable on every node (under a shared run.storage).")
    config: dict[str, Any] | str | None = Field(
        None,
        description="HF config (a dict with model_type, or a config.json path): random init. "
        "With `path` too, the model is built once, saved to `path`, then loaded from there.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory or hub id; default: model.path.")
    revision: str | None = Field(
        None, pattern=r"^[0-9a-f]{40}$", description="The hub commit (40 hex digits) of a hub model.path, fetched "
        "on every node: what was reviewed is what trains. Unset: the repository's main branch at fetch time.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Recompute decoder blocks' activations in the backward pass instead of keeping them "
        "from the forward: less memory for more compute. none; full: every block; selective: every "
        "activation_checkpointing_every-th block, the others keep their activations (memory and recompute in "
        "between). true and false, the older form, still mean full and none.")
    activation_checkpointing_every: int = Field(
        2, ge=1, description="selective: checkpoint the Nth, 2Nth, ... decoder block (1: every block, as full).")
    activation_checkpointing_keeps: Literal["inputs", "matmuls"] = Field(
        "inputs", description="What a checkpointed block keeps for the backward pass. inputs: its input alone, and "
        "the whole block runs again. matmuls: also the outputs of its matrix multiplications and attention kernel, "
        "so only its cheap elementwise ops (norms, rotary, activations) run again: more memory than inputs, "
        "almost no recompute.")
    attn_implementation: Literal["auto", "flash_attention_2", "flex_attention", "sdpa", "eager"] = Field(
        "auto", description="Attention kernel; every one keeps packed examples apart. auto, among the kernels the "
        "model supports: on a GPU flash_attention_2 (bf16, sm_80+, flash-attn loads), else flex_attention (a block "
        "mask, where the GPU's shared memory fits its backward), else sdpa, else eager; on a CPU sdpa, or eager for "
        "a model without it (Gemma 2). An explicit kernel the model or model.dtype cannot run is refused before Ray "
        "starts, naming the kernels that would work.")
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")
    lora: LoraSection | None = Field(None, description="Train LoRA adapters instead of every weight (absent: full fine-tuning).")

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _boolean_form(cls, value: Any) -> Any:
        if isinstance(value, bool):  # specs written before the modes: true was every block
            return "full" if value else "none"
        return value

    @model_validator(mode="after")
    def _needs_a_source(self) -> "ModelSection":
        if self.path is None and self.config is None:
            raise ValueError("set model.path (a model directory or hub id) or model.config")
        if self.path is None and self.tokenizer is None:
            raise ValueError("model.tokenizer is required when the model is built from model.config alone")
        if self.revision is not None and (self.path is None or "://" in self.path):
            raise ValueError("model.revision pins a hub model's commit; model.path is not a hub id")
        if self.config is not None and self.path is not None and "://" in self.path:
            raise ValueError(f"model.path: {self.path} cannot take a model built from model.config (it is saved to "
                             "a local directory); drop model.path, or upload the built model and drop model.config")
        return self


class DpoSection(_Section):
    beta: float = Field(0.1, gt=0, description="How far the policy may move from the reference model: the reward "
                        "of a response is beta times its log-probability gain over the reference.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="The share of pairs assumed mislabelled "
                                   "(conservative DPO); 0: plain DPO.")
    sft_weight: float = Field(0.0, ge=0, description="Weight of the chosen response's per-token NLL added to each "
                              "pair's loss (as RPO); 0: none.")
    dropout: bool = Field(False, description="Keep the model's dropout (LoRA's too) on in the policy. Off by default, "
                          "as TRL's DPO does: the reference is scored without dropout, so dropout in the policy "
                          "alone turns the rewards into noise.")


class TrainSection(_Section):
    steps: int = Field(100, gt=0)
    micro_batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    schedule_extension: Literal["constant", "restart", "stretch"] = Field(
        "constant", description="A run resumed with other train.steps than its schedule was planned for (a finished "
        "run trained on): constant: the planned schedule runs to its end, then the LR stays at its final value; "
        "restart: a new warmup and cosine over the steps left; stretch: the cosine recomputed over the new total "
        "(the LR jumps back up). Said before it trains.")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    eval_every: int = Field(0, ge=0, description="Steps between evaluations; 0: only at the end.")
    seed: int = 0
    accum_sync: Literal["auto", "reduce_scatter_every_micro_batch", "last"] = Field(
        "auto", description="When gradients are reduce-scattered during grad_accum: after every micro-batch (sharded "
        "gradients only; one reduce-scatter per micro-batch) or after the last one (fewer collectives, but every "
        "worker holds the unsharded fp32 gradients in between); auto: every micro-batch on GPU, last on CPU.")
    compile: bool = Field(
        False, description="torch.compile each decoder block before sharding (Inductor: Triton kernels on a GPU, C++ "
        "on a CPU); the embedding and the loss's chunked LM head stay eager. The first step pays for compiling "
        "(seconds to a minute per distinct block); the loss is the same to float rounding.")
    objective: Literal["sft", "dpo"] = Field(
        "sft", description="sft: next-token loss on the trained tokens; dpo: preference tuning on data.format: "
        "preference pairs against the model as it starts (train.dpo).")
    dpo: DpoSection = DpoSection()


class ScalingSection(_Section):
    workers: int | Literal["auto"] | tuple[int, int] = Field(
        2, description="Ray Train workers; auto: one per GPU in the cluster; [min, max]: elastic, the run goes on "
        "with as few as min workers when nodes are lost (micro-batches per step grow to keep the global batch).")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpus_per_worker: int = Field(1, gt=0)
    expect_fabric: Literal["any", "efa", "socket"] = Field(
        "any", description="efa: refuse to train when NCCL across nodes does not use EFA.")

    @field_validator("workers")
    @classmethod
    def _positive(cls, value: int | str | tuple[int, int]) -> int | str | tuple[int, int]:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1")
        if isinstance(value, tuple) and not 1 <= value[0] <= value[1]:
            raise ValueError(f"a range [min, max] needs 1 <= min <= max (got {list(value)})")
        return value

    @property
    def elastic(self) -> bool:
        return isinstance(self.workers, tuple) and self.workers[0] < self.workers[1]

    @property
    def max_workers(self) -> int | None:
        """The most workers the run asks for; None for auto."""
        return self.workers[1] if isinstance(self.workers, tuple) else None if self.workers == "auto" else self.workers

    @property
    def min_workers(self) -> int | None:
        return self.workers[0] if isinstance(self.workers, tuple) else self.max_workers


class ParallelSection(_Section):
    """How the workers split the model (FSDP2): `replicate` × `shard` workers, dim 0 replicates, dim 1 shards (HSDP)."""

    replicate: int | Literal["auto"] = Field(
        "auto", description="Copies of the sharded model (across nodes); 1: plain FSDP over every worker. auto: "
        "the number of nodes when the sharded state fits one node (see shard), else 1.")
    shard: int | Literal["auto"] = Field(
        "auto", description="Workers each copy is sharded over (within a node); must divide a node's workers when "
        "replicate > 1. auto: a node's workers when parameters, gradients and optimizer state sharded over one node "
        "take at most half of a worker's memory (the memory estimate's items), else every worker.")

    @field_validator("replicate", "shard")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1")
        return value


class CheckpointSection(_Section):
    every_steps: int = Field(50, ge=0, description="0: no periodic checkpoints.")
    keep: int = Field(2, ge=1)
    mode: Literal["sync", "async"] = Field(
        "async", description="async: the loop waits only while the state is copied to host memory; the write to the "
        "staging directory and the upload to run.storage go on in the background, one save at a time. sync: the loop "
        "waits until the checkpoint is complete in storage.")


class ExportSection(_Section):
    merge: bool = Field(True, description="With model.lora: also write final/, the base model with the adapter merged in.")


class RunSection(_Section):
    name: str = "run"
    storage: str = Field("runs", description="Local directory or s3://bucket/prefix; the run lives in <storage>/<name>.")
    max_failures: int = Field(2, ge=0, description="Worker-group restarts from the latest checkpoint.")
    max_hours: float | None = Field(
        None, gt=0, description="On a cluster: the RayJob's activeDeadlineSeconds; the job is stopped after this long.")
    trackers: list[Literal["tensorboard", "mlflow"]] = Field(
        [], description="Also log the per-step metrics to TensorBoard (<run>/tensorboard/) and/or MLflow.")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; default: MLFLOW_TRACKING_URI.")
    experiment: str | None = Field(None, description="MLflow experiment; default: run.name up to its first '-'.")
    mlflow_secret: str | None = Field(
        None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="On a cluster: the Kubernetes Secret the pods read MLFLOW_TRACKING_TOKEN (or _USERNAME and "
        "_PASSWORD) from, through the cluster spec's `secrets`; render and submit --cluster check they do.")

    @field_validator("trackers")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"names a tracker twice (got {value})")
        return value

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
            raise ValueError("use letters, digits, '.', '_' and '-' (at most 100)")
        return value

    @model_validator(mode="after")
    def _secret_for_mlflow(self) -> "RunSection":
        if self.mlflow_secret and "mlflow" not in self.trackers:
            raise ValueError("mlflow_secret is set but run.trackers does not name mlflow")
        return self


class RuntimeSection(_Section):
    pip: list[str] = Field(
        [], description="Extra pip requirements for the job's nodes, each pinned with its files' sha256 (e.g. "
        "['liger-kernel==0.6.4 --hash=sha256:…']); on a cluster they travel in the job's runtime_env with the "
        "packages the spec's features need beyond the image, installed by pip in hash-checking mode.")

    @field_validator("pip")
    @classmethod
    def _requirements(cls, value: list[str]) -> list[str]:
        from trainlift.catalog.packages import requirement_problem

        for line in value:
            if (problem := requirement_problem(line)) is not None:
                raise ValueError(problem)
        return value


class JobSpec(_Section):
    model: ModelSection
    data: DataSection
    train: TrainSection = TrainSection()
    scaling: ScalingSection = ScalingSection()
    parallel: ParallelSection = ParallelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    export: ExportSection = ExportSection()
    run: RunSection = RunSection()
    runtime: RuntimeSection = RuntimeSection()

    @model_validator(mode="before")
    @classmethod
    def _no_uri_credentials(cls, raw: Any) -> Any:
        """Every field travels in the job's entrypoint (`ray job list`, `ps`) and its tracker params: no field may
        hold a credential (redact.py: user:password@, a token, a signed URL...). Checked before any other rule, so
        no other error echoes the value."""
        for parts, text in _strings(raw):
            if (problem := credential_problem(text)) is not None:
                raise ValueError(f"{field_path(parts)}: {problem[0]}; {problem[1]}")
        return raw

    @model_validator(mode="after")
    def _objective_fits_the_data(self) -> "JobSpec":
        if self.train.objective == "dpo" and self.data.format not in ("auto", "preference"):
            raise ValueError(f"train.objective: dpo learns from pairs of responses, but data.format is "
                             f"{self.data.format}; set data.format: preference (rows of prompt, chosen, rejected)")
        if self.train.objective == "sft" and self.data.format == "preference":
            raise ValueError("data.format: preference rows are pairs for train.objective: dpo; set it (the objective "
                             "is sft)")
        return self

    @property
    def is_remote_storage(self) -> bool:
        return "://" in self.run.storage

    @property
    def run_uri(self) -> str:
        return f"{self.run.storage.rstrip('/')}/{self.run.name}"


def _strings(value: Any, parts: tuple = ()):
    """(field path parts, text) for every string in a raw spec, keys of nested mappings included."""
    if isinstance(value, str):
        yield parts, value
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from _strings(key, parts + (key,))
            yield from _strings(child, parts + (key,))
    elif isinstance(value, (list, tuple)):
        for i, child in enumerate(value):
            yield from _strings(child, parts + (i,))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], c), the value parsed as YAML so numbers and lists keep their type."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"--set {text!r}: expected KEY=VALUE", hint="e.g. --set train.steps=20")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SpecError(f"--set {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def validate_job_spec(raw: dict[str, Any], source: str = "spec", overrides: Sequence[str] = ()) -> JobSpec:
    """The spec, or one line for its first problem, blamed on the `--set` that gave the field when one did."""
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as exc:
        where = field_path(exc.errors()[0]["loc"])
        given = [o for o in overrides if f"{o.partition('=')[0].strip()}.".startswith(f"{where}.")]
        problem = first_error(exc) + unknown_key_suggestion(JobSpec, exc)
        if given:
            raise SpecError(f"--set {uri_credentials(given[-1])}: {problem}",
                            hint="fix the --set key or value") from None
        raise SpecError(f"{source}: {problem}", hint="fix the spec file or pass --set KEY=VALUE") from None


def load_job_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """The spec file with `overrides` (`--set KEY=VALUE`) applied. Relative paths in the file are relative to its
    directory; in an override, to the current directory."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such spec file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise SpecError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: the spec must be a YAML mapping with model, data, train, ... sections")
    return validate_job_spec(apply_overrides(relative_to_spec(raw, path.parent), overrides), source=str(path),
                             overrides=overrides)
