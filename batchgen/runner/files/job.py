"""A prepared job: config + identity + paths, handed from the supervisor to the workers as JSON
(never pickle)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchgen.atomic import atomic_file
from batchgen.config import JobConfig, StorageConfig
from batchgen.io.jobfiles import FingerprintMismatch, JobPaths, make_fingerprint
from batchgen.io.reader import (DEFAULT_MAX_LINE_BYTES, InputFileError, file_version,
                               identify_input)


@dataclass(frozen=True)
class JobSpec:
    config: JobConfig
    batch_id: str
    input_sha256: str
    total_records: int
    created: int
    """Unix time of the job's first start; result lines use it so a resume writes identical
    lines."""
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    """The model's sampling defaults (generation_config.json, --generation-config auto) for
    the fields a line leaves out: the workers fill them in (intake.with_model_defaults)."""
    chat_template: str | None = None
    """--chat-template's text, read once by the supervisor (and fingerprinted): the workers
    render chat lines with it, never reading the file again."""
    system_fingerprint: str | None = None
    """OpenAI's `system_fingerprint` of every answer (jobfiles.system_fingerprint of the job's
    recorded fingerprint: the same on a resume)."""
    model_commit: str | None = None
    """The Hub commit the job's fingerprint pins --model to (None for a local folder or file):
    every rank of every node loads that commit (`pinned`), not what a branch names in its
    own cache, which another node's cold cache may download anew after the branch moved."""

    def pinned(self) -> JobSpec:
        """This spec with --revision set to `model_commit`: what the workers load. The spec
        file keeps the flags as given (followers compare theirs with them)."""
        if self.model_commit is None:
            return self
        model = dataclasses.replace(self.config.engine.model, revision=self.model_commit)
        engine = dataclasses.replace(self.config.engine, model=model)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, engine=engine))

    @property
    def paths(self) -> JobPaths:
        s = self.config.storage
        return JobPaths.for_job(s.storage_path, self.batch_id, s.incremental_output_dir, s.output)

    def spec_file(self) -> Path:
        return self.paths.spec_file

    def save(self) -> Path:
        path = self.spec_file()
        with atomic_file(path) as f:  # no-follow, fsynced, all or nothing
            f.write(self.to_bytes())
        return path

    def to_bytes(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @staticmethod
    def load(path: str | Path) -> JobSpec:
        return JobSpec.from_bytes(Path(path).read_bytes())

    @staticmethod
    def from_bytes(data: bytes) -> JobSpec:
        raw = orjson.loads(data)
        return JobSpec(config=_config_from_dict(JobConfig, raw.pop("config")), **raw)


def _config_from_dict(cls, data: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = data[f.name]
        sub = f.default_factory  # type: ignore[misc]
        if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
            value = _config_from_dict(sub, value)
        kwargs[f.name] = value
    return cls(**kwargs)


def fingerprint(config: JobConfig, input_sha256: str, model_identity: str,
                model_weights: str, device_type: str = "cpu",
                default_max_tokens_used: bool = True,
                sampling_defaults: dict | None = None,
                chat_template: str | None = None) -> dict:
    """What decides the answers: a resume with any of it changed is refused. The dtypes are
    recorded as they resolve on `device_type` ("auto" is bfloat16 on CUDA, float32 on the
    CPU; the KV cache's "auto" is the model's dtype), so a job started on the CPU is not
    resumed on a GPU in another precision, and `--dtype float32` resumes a CPU job started
    with "auto". --max-tokens counts only where a request takes it
    (`default_max_tokens_used`); the model's sampling defaults (prepare.sampling_defaults)
    only where there are some, --chat-template's text (as a hash) only where given."""
    m = config.engine.model
    out = config.output
    optional = {}  # absent at their defaults: jobs started before they existed still resume
    if default_max_tokens_used and config.storage.max_tokens != StorageConfig.max_tokens:
        optional["default_max_tokens"] = config.storage.max_tokens
    if m.max_model_len is not None:
        optional["max_model_len"] = m.max_model_len
    if sampling_defaults:
        optional["sampling_defaults"] = dict(sampling_defaults)
    if chat_template is not None:  # --chat-template's text decides every chat prompt
        optional["chat_template"] = hashlib.sha256(chat_template.encode()).hexdigest()[:16]
    return make_fingerprint({
        **optional,
        "input_sha256": input_sha256,
        "model": model_identity,
        "model_weights": model_weights,
        **resolved_dtypes(m.dtype, m.kv_dtype, device_type),
        "seed": config.engine.runtime.seed,
        "parse_thinking": out.parse_thinking,
        "parse_tool_call": out.parse_tool_call,
        "reasoning_field": out.reasoning_field,
        "include_special_tokens": out.detokenization_include_special_tokens,
        # The format forced tool calls are decoded in and parsed from; recorded only when
        # named, so jobs started before it was recorded still resume.
        **({} if out.tool_call_parser == "auto" else {"tool_call_parser": out.tool_call_parser}),
        # Decides which lines are read (custom_ids of longer ones are not); recorded only when
        # set, so jobs started before the limit existed still resume.
        **({} if config.storage.max_line_bytes == DEFAULT_MAX_LINE_BYTES
           else {"max_line_bytes": config.storage.max_line_bytes}),
    })


def resolved_dtypes(dtype: str, kv_dtype: str, device_type: str) -> dict[str, str]:
    """{"dtype", "kv_dtype"} as a run on `device_type` resolves them ("auto" made concrete)."""
    if dtype == "auto":
        dtype = "bfloat16" if device_type == "cuda" else "float32"
    return {"dtype": dtype, "kv_dtype": dtype if kv_dtype == "auto" else kv_dtype}


def now() -> int:
    return int(time.time())


def check_input_unchanged(spec: JobSpec, version: tuple[int, ...]) -> None:
    """Refuse to publish results when the input was edited or replaced after the job read its
    identity (`version` was taken before): the lines are parsed after its sha256 was taken,
    so answers to edited lines would go out under the original input's identity. Re-hashes only
    when the file's version moved."""
    path = Path(spec.config.storage.input)
    if file_version(path) == version:
        return
    try:
        now_sha = identify_input(path).sha256
    except InputFileError as err:
        raise InputFileError(f"{err}. The input went away while job {spec.batch_id} ran: "
                             "nothing was published; put the input back and re-run the same "
                             "command (the finished results are kept)") from None
    if now_sha != spec.input_sha256:
        raise FingerprintMismatch(
            f"the input {path} changed while job {spec.batch_id} ran (sha256 "
            f"{spec.input_sha256[:16]}... -> {now_sha[:16]}...): some results may answer the "
            "edited lines. Nothing was published. Start the job over from the input you want "
            f"(a new --batch-id, or delete {spec.paths.incremental_dir}/{spec.batch_id}*.jsonl "
            f"and batches/{spec.batch_id}*), rather than restoring the old input.")
