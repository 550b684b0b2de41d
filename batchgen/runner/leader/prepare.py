"""A job before its workers start: the input hashed and parsed once, the job's identity and
folders, and its record in the batch file under a fingerprint of what decides the answers
(a resume with any of it changed is refused). No weights are loaded here."""

from __future__ import annotations

import logging
from pathlib import Path

from batchgen.config import JobConfig, read_chat_template
from batchgen.io.checkpoints import checkpoint_files, load
from batchgen.io.jobfiles import (BatchFile, FingerprintMismatch, JobPaths, check_fingerprint,
                                  derive_batch_id, pinned_commit, record_upload,
                                  system_fingerprint)
from batchgen.io.parsed_input import parse_input, remove_parsed
from batchgen.io.reader import InputFile, InputFileError, InputSummary, identify_input
from batchgen.io.sampling_fields import BadLine, model_defaults
from batchgen.io.writer import final_files_complete, read_done_ids
from batchgen.models import hub
from batchgen.models.factory import generation_config
from batchgen.models.loader import CheckpointError, resolve_model, weights_signature
from batchgen.parallel import pick_device
from batchgen.runner.files.job import JobSpec, fingerprint, now
from batchgen.runner.files.job_dirs import claim_incremental, make_job_dirs
from batchgen.runner.leader.records import result_files
from batchgen.runner.worker.outputs import outputs_belong_to

log = logging.getLogger("batchgen.job")


def model_identity(config: JobConfig) -> str:
    return config.engine.model.model or "embedded:SmolLM2-135M-Instruct"


def model_weights(config: JobConfig, quiet: bool = False, pinned: str | None = None) -> str:
    """The signature of the weights --model names (`weights_signature`): a resume must not mix
    answers of two models behind one path. What --model names, not what is read: a
    --converted-ckpt-dir folder is derived from it, and written by the first run. The
    embedded model is pinned by its package. `quiet`: without the log line saying that a
    --revision is ignored. `pinned`: the Hub commit the job started with (hub.CommitMoved
    instead of downloading another)."""
    m = config.engine.model
    if m.model is None:
        return "embedded"
    source = resolve_model(m.model, m.cache_dir, m.revision, pinned)
    if source.revision_ignored and not quiet:
        log.warning("--revision %s is ignored: --model %s is the folder or file %s, not a Hub "
                    "snapshot", m.revision, m.model, source.path)
    return weights_signature(source.path)


def chat_template(config: JobConfig) -> str | None:
    """--chat-template's text, read here once: the fingerprint and the workers take this."""
    value = config.engine.model.chat_template
    return None if value is None else read_chat_template(value)


def sampling_defaults(config: JobConfig, quiet: bool = False) -> dict:
    """What lines that leave a sampling field out are answered with (--generation-config
    auto): the fields of sampling_fields.MODEL_DEFAULT_FIELDS that --model's
    generation_config.json sets, as vLLM reads them. None for a .gguf file or the embedded
    model (they carry no such file); CheckpointError for a value no line could give.
    A folder given as --generation-config (vLLM's form) is read instead of the model's.
    `quiet`: without the log line saying which it took."""
    m = config.engine.model
    if m.generation_config in ("none", "vllm"):
        return {}
    if m.generation_config != "auto":
        path = Path(m.generation_config).expanduser()
    elif m.model is None:
        return {}
    else:
        path = resolve_model(m.model, m.cache_dir, m.revision).path
    if not path.is_dir():
        return {}
    try:
        defaults = model_defaults(generation_config(path))
    except BadLine as bad:
        raise CheckpointError(f"{path / 'generation_config.json'}: {bad}; fix the file, or "
                              "run with --generation-config none (OpenAI's defaults)") from None
    if defaults and not quiet:
        log.info("lines that leave them out are sampled with generation_config.json's %s "
                 "(--generation-config none: OpenAI's defaults)",
                 ", ".join(f"{k} {v}" for k, v in defaults.items()))
    return defaults


def identify(config: JobConfig) -> tuple[InputFile, JobPaths]:
    """Hash the input and derive the job identity; creates the job's folders, nothing else."""
    s = config.storage
    source = identify_input(Path(s.input))
    batch_id = s.batch_id or derive_batch_id(source.sha256)
    paths = JobPaths.for_job(s.storage_path, batch_id, s.incremental_output_dir, s.output)
    make_job_dirs(config, paths)
    return source, paths


def parse(config: JobConfig, source: InputFile, paths: JobPaths) -> InputSummary:
    """The one pass that parses the input (under the job lock): every record checked and
    stored for the workers (paths.parsed_input); duplicates and an empty input refused."""
    s = config.storage
    summary = parse_input(source, paths.parsed_input, s.max_line_bytes, s.max_tokens)
    if summary.records == 0:
        remove_parsed(paths.parsed_input)
        raise InputFileError(f"input file {s.input} holds no requests "
                             f"({summary.why_no_requests()})")
    return summary


def job_device_type(config: JobConfig) -> str:
    """"cuda" or "cpu": where the workers will run (`pick_device`, as they choose it)."""
    return pick_device(config.engine.runtime.device).type


def _as_recorded_then(old: dict, new: dict, config: JobConfig,
                      summary: InputSummary | None = None) -> dict:
    """`new` in the form of a fingerprint recorded by an earlier version: without the weights'
    signature if it lacks one, with the dtype flags as given if it recorded them so ("auto").
    Where no request takes --max-tokens, its recorded value (or absence) is kept: it decides
    nothing."""
    new = dict(new)
    if "model_weights" not in old:
        new.pop("model_weights", None)
    unused = summary is not None and summary.default_max_tokens_lines == 0
    if unused and "default_max_tokens" in old:  # `new` leaves it out then (fingerprint)
        new["default_max_tokens"] = old["default_max_tokens"]
    if "auto" in (old.get("dtype"), old.get("kv_dtype")):
        new.update(dtype=config.engine.model.dtype, kv_dtype=config.engine.model.kv_dtype)
    return new


def completed_already(config: JobConfig, source: InputFile, paths: JobPaths) -> bool:
    """Whether this job is on record as completed under this run's settings, its final files
    whole: a rerun then has nothing to do and need not parse the input (a million lines take
    tens of seconds). Any doubt answers False, and the full check (parse, prepare) decides."""
    state = BatchFile(paths.batch_file).load()
    if state is None or state.status != "completed" or not state.fingerprint:
        return False
    recorded = state.fingerprint
    pinned = job_commit(config, recorded)
    defaults = None
    if pinned is not None and _revision_as_then(config, paths, pinned):
        # A Hub commit fixes its files: what the job recorded of them stands, whatever this
        # node's cache holds (a cold one would download the model) and wherever the branch
        # went since (the job answered with that commit). No request, nothing read.
        weights = recorded.get("model_weights", "")
        if config.engine.model.generation_config == "auto":  # the commit's own file
            defaults = recorded.get("sampling_defaults", {})
    else:
        try:
            weights = model_weights(config, True, pinned)
        except hub.CommitMoved:
            return False  # prepare refuses it, before any download
    if defaults is None:
        defaults = sampling_defaults(config, quiet=True)
    # As if some line took --max-tokens: it is recorded then, so a changed one is a doubt.
    fp = fingerprint(config, source.sha256, model_identity(config), weights,
                     job_device_type(config), True, defaults, chat_template(config))
    try:
        check_fingerprint(state.fingerprint, _as_recorded_then(state.fingerprint, fp, config))
    except FingerprintMismatch:
        return False
    return final_files_whole(paths, state.request_counts.get("total", -1))


def _revision_as_then(config: JobConfig, paths: JobPaths, pinned: str) -> bool:
    """Whether --revision is the one the job was started with (its spec keeps the flags as
    given), or the commit it is pinned to: the same command, not a request for other weights."""
    revision = config.engine.model.revision
    if revision == pinned:
        return True
    try:
        then = JobSpec.load(paths.spec_file)
    except (OSError, ValueError, KeyError, TypeError):
        return False  # the full check decides
    return (then.config.engine.model.revision or "main") == (revision or "main")


def final_files_whole(paths: JobPaths, records: int) -> bool:
    """Whether the final output files hold one line of this job per input record (a file
    deleted, cut or edited by hand, or another job's, makes the next run merge them again)."""
    return final_files_complete(paths.output, paths.errors_output, records) and \
        outputs_belong_to(paths.batch_id, paths.output, paths.errors_output)


def decided_something(paths: JobPaths) -> bool:
    """Whether earlier runs of the job left answers made under its recorded settings: a saved
    result, or tokens an in-flight checkpoint holds (a job of long answers may run for hours
    before its first result, and its resume continues those tokens)."""
    done = read_done_ids(paths.incremental_files())
    if done:
        return True
    return any(load(path, None, done)[1].tokens
               for path in checkpoint_files(paths.batch_file, paths.batch_id))


def job_commit(config: JobConfig, recorded: dict) -> str | None:
    """The Hub commit a job's recorded fingerprint pins --model to; None when it records none,
    or another --model (that resume is refused by the fingerprint, naming the model)."""
    if not recorded or recorded.get("model") != model_identity(config):
        return None
    return pinned_commit(recorded)


def resumed_weights(config: JobConfig, state, paths: JobPaths) -> str:
    """`model_weights`, for a job pinned to a Hub commit by an earlier run: where --model's
    branch is not on disk and now names another commit (it moved on the Hub, and this node's
    cache is cold), the resume is refused before that commit's weights are downloaded, not
    after. A job that decided nothing yet takes this run's commit (`prepare`)."""
    pinned = job_commit(config, state.fingerprint) if state is not None else None
    try:
        return model_weights(config, pinned=pinned)
    except hub.CommitMoved as moved:
        if decided_something(paths):
            raise FingerprintMismatch(
                f"refusing to resume: --model {moved.repo} at revision {moved.revision} now "
                f"names Hub commit {moved.commit} (its branch moved, or another --revision), "
                f"this job started with {moved.pinned}: add --revision {moved.pinned} to finish "
                "it with the weights it started with (nothing was downloaded), or start a new "
                "job (--batch-id or another --storage-path)") from None
        return model_weights(config)


def prepare(config: JobConfig, summary: InputSummary, paths: JobPaths) -> tuple[JobSpec, BatchFile]:
    """Check the fingerprint and record a new job (under the job lock). No weights loaded."""
    batch_id, s = paths.batch_id, config.storage
    batch_file = BatchFile(paths.batch_file)
    state = batch_file.load()
    weights = resumed_weights(config, state, paths)  # first: a Hub model is downloaded here
    defaults, template = sampling_defaults(config), chat_template(config)
    fp = fingerprint(config, summary.sha256, model_identity(config), weights,
                     job_device_type(config), summary.default_max_tokens_lines != 0, defaults,
                     template)
    retake = False
    if state is not None and state.fingerprint:
        try:
            check_fingerprint(state.fingerprint,
                              _as_recorded_then(state.fingerprint, fp, config, summary))
        except FingerprintMismatch:
            if decided_something(paths):
                raise
            # A run that stopped before its first result and its first token (a failed
            # preflight, a model that would not load) decided nothing: this run's settings
            # become the job's.
            log.info("job %s has no saved result yet: it runs with this command's settings",
                     batch_id)
            paths.incremental_owner.unlink(missing_ok=True)
            retake = True
    claim_incremental(paths, fp, job_recorded=state is not None,
                      as_recorded=lambda old, new: _as_recorded_then(old, new, config, summary))
    created = int(state.timings.get("created_at", now())) if state else now()
    recorded = state.fingerprint if state is not None and state.fingerprint and not retake else fp
    spec = JobSpec(config, batch_id, summary.sha256, summary.records, created, defaults,
                   template, system_fingerprint(recorded), pinned_commit(recorded))
    if state is None or not state.fingerprint:  # no fingerprint: a stub, the end of a run
        # recorded into a job folder deleted while it ran (nothing of the job is left)
        record_upload(paths, Path(s.input), summary.sha256, summary.size_bytes, summary.records,
                      summary.format)
        batch_file.update(batch_id, status="validating", input_file=str(Path(s.input).resolve()),
                          fingerprint=fp, timings={"created_at": created}, **result_files(paths),
                          request_counts={"total": summary.records, "completed": 0, "failed": 0})
    elif retake:  # the job is this run's now: its input too (status reads the total)
        record_upload(paths, Path(s.input), summary.sha256, summary.size_bytes, summary.records,
                      summary.format)
        batch_file.update(batch_id, fingerprint=fp, input_file=str(Path(s.input).resolve()),
                          request_counts={"total": summary.records, "completed": 0,
                                          "failed": 0})
    return spec, batch_file
