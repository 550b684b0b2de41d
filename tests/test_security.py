"""custom_id never becomes a path; the host KV segment leaves nothing behind; the worker
channel is JSON (no pickle); templates render in transformers' sandbox."""

import json
import os
import stat

from batchgen.engine.host_pool import SHM_DIR, HostSegment
from job_utils import batchgen, read_jsonl, write_jsonl


def test_custom_id_is_never_a_path(tmp_path, tiny_chat_model):
    evil = "../../../escape"
    rows = [{"custom_id": evil, "prompt": "hi", "max_tokens": 2},
            {"custom_id": "/abs/path", "prompt": "hi", "max_tokens": 2}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    work = tmp_path / "deep" / "er"
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", work / "s",
             check=True)
    assert not (tmp_path / "escape").exists() and not (work / "escape").exists()
    names = {p.name for p in (work / "s").rglob("*")}
    assert not any("escape" in n or "abs" in n for n in names)
    out = [p for p in (work / "s" / "outputs").glob("*.jsonl") if "errors" not in p.name][0]
    assert [r["custom_id"] for r in read_jsonl(out)] == [evil, "/abs/path"]


def test_worker_spec_is_json_not_pickle(tmp_path, tiny_chat_model):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    batchgen("run", "--input", inp, "--model", tiny_chat_model, "--storage-path", tmp_path / "s",
             check=True)
    spec = next((tmp_path / "s" / "batches").glob("*.spec.json"))
    assert (json.loads(spec.read_text())["config"]["engine"]["model"]["model"]
            == str(tiny_chat_model))


def test_host_segment_is_private_and_leaves_nothing_in_dev_shm():
    before = set(os.listdir(SHM_DIR))
    created = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):
        fd = real_open(path, flags, mode, *a, **kw)
        if str(path).startswith(SHM_DIR):
            created.append((flags, stat.S_IMODE(os.fstat(fd).st_mode)))
        return fd

    os.open = spy
    try:
        segment = HostSegment(1 << 20)
    finally:
        os.open = real_open
    assert created and all(flags & os.O_EXCL and mode == 0o600 for flags, mode in created)
    assert set(os.listdir(SHM_DIR)) == before  # unlinked as soon as it was mapped
    segment.tensor[:10] = 7  # still usable through the mapping
    segment.close()


def test_chat_templates_render_sandboxed():
    """Intake renders through transformers, whose template compiler uses jinja's sandbox."""
    from jinja2.sandbox import SandboxedEnvironment
    from transformers.utils import chat_template_utils

    compiled = chat_template_utils._compile_jinja_template("{{ messages[0]['content'] }}")
    assert isinstance(compiled.environment, SandboxedEnvironment)


def test_segment_files_of_dead_processes_are_removed(tmp_path):
    """A kill between creating the segment's file and unlinking it leaves an empty file in
    /dev/shm; the next segment removes those of dead processes, and only those."""
    import subprocess
    import sys

    from batchgen.engine.host_pool import remove_orphans

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"batchgen-kv-{dead_pid}-0011223344aa"
    live = tmp_path / f"batchgen-kv-{os.getpid()}-5566778899bb"
    other = tmp_path / "someone-elses-file"
    for path in (orphan, live, other):
        path.write_bytes(b"")
    remove_orphans(str(tmp_path), "batchgen-kv-")
    assert not orphan.exists() and live.exists() and other.exists()
