"""Preemption: SIGTERM / SIGUSR1 stop the job within --preempt-grace with exit code 75
("requeue me"); the same command then resumes to a result identical to a clean run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from batchgen.testing.faults import STUCK_ENV
from test_reliability_support import (
    batch_state,
    check_against_clean,
    count_lines,
    job_input,
    kill_group,
    launch,
    record_figures,
    run,
    wait_for,
    worker_pids,
)

GRACE = 6.0
MARGIN = 3.0
"""Interpreter teardown of the workers and the supervisor after the grace period."""


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (its own signal handlers, its own imports)."""
    return subprocess.run([sys.executable, "-c", code, *args], timeout=timeout,
                          capture_output=True, text=True)


def _results_flow(storage) -> bool:
    return count_lines(storage) >= 1 and bool(worker_pids(storage))


def _in_stuck_step(storage) -> bool:
    """The worker wrote its first stats (after the prefill step): the next step is a decode
    step, which the STUCK_ENV fault makes sleep."""
    if not worker_pids(storage):
        return False
    time.sleep(0.5)
    return True


def _signal_mid_run(inp, storage, model, sig, everyone: bool, *extra,
                    ready=_results_flow, env=None) -> tuple[int, float, str]:
    """Start the job, wait until `ready`, send `sig`; (exit code, seconds to exit, stderr).
    everyone: like Slurm, signal the workers too, not only the supervisor's process group."""
    proc = launch(inp, storage, model, "--preempt-grace", GRACE, *extra, env=env)
    assert wait_for(lambda: ready(storage), 120), proc.communicate()[1][-3000:]
    t0 = time.monotonic()
    kill_group(proc, sig)
    if everyone:
        for pid in worker_pids(storage):
            os.kill(pid, sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - t0, err


@pytest.mark.slow
@pytest.mark.parametrize("sig,everyone", [(signal.SIGTERM, False), (signal.SIGUSR1, True),
                                         (signal.SIGQUIT, True)],
                         ids=["sigterm-supervisor", "sigusr1-every-process",
                              "sigquit-every-process"])
def test_stop_signal_requeues_then_resume_completes(tmp_path, tiny_chat_model, sig, everyone):
    inp = job_input(tmp_path)
    storage = tmp_path / "s"
    code, seconds, err = _signal_mid_run(inp, storage, tiny_chat_model, sig, everyone)
    assert code == 75, err[-3000:]
    assert seconds < GRACE + MARGIN
    assert "Traceback" not in err and "re-run the same command to resume" in err
    assert batch_state(storage)["status"] == "in_progress"
    done_at_stop = count_lines(storage)
    assert 0 < done_at_stop < 32
    run(inp, storage, tiny_chat_model, check=True)
    figures = check_against_clean(storage, tiny_chat_model)
    record_figures(f"signal_{signal.Signals(sig).name}", exit_code=code, seconds=round(seconds, 2),
                   grace=GRACE, done_at_stop=done_at_stop, **figures)


@pytest.mark.slow
def test_grace_period_bounds_a_step_that_does_not_end(tmp_path, tiny_chat_model):
    # Each decode step sleeps 60 s: the worker cannot reach its next flush, so it must leave
    # by itself inside the grace period (finished lines are durable at every instant).
    code, seconds, err = _signal_mid_run(job_input(tmp_path), tmp_path / "s", tiny_chat_model,
                                         signal.SIGTERM, False, env={STUCK_ENV: "60"},
                                         ready=_in_stuck_step)
    assert code == 75, err[-3000:]
    assert seconds < GRACE + MARGIN
    record_figures("grace_with_stuck_step", exit_code=code, seconds=round(seconds, 2), grace=GRACE)


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path, tiny_chat_model):
    storage = tmp_path / "s"
    proc = launch(job_input(tmp_path), storage, tiny_chat_model, "--preempt-grace", "60",
                  env={STUCK_ENV: "60"})
    assert wait_for(lambda: _in_stuck_step(storage), 120)
    kill_group(proc, signal.SIGTERM)
    time.sleep(2.5)  # more than SAME_NOTICE_S: a second notice, not Slurm's duplicate
    assert proc.poll() is None, "the first signal must wait for the step (grace 60 s)"
    t0 = time.monotonic()
    kill_group(proc, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err[-3000:]
    assert time.monotonic() - t0 < MARGIN


def test_workers_stop_on_every_stop_signal():
    """Each signal that stops the job stops a worker at its next step: the agent forwards the
    supervisor's signal, and a default action (SIGQUIT: die and dump core) would lose the
    step in flight and could fill the disk with a core the size of the weights."""
    from batchgen.runner.exits import STOP_SIGNALS
    from batchgen.runner.worker.process import WORKER_STOP_SIGNALS

    assert set(WORKER_STOP_SIGNALS) == {getattr(signal, name) for name in STOP_SIGNALS}


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT", "SIGHUP", "SIGQUIT"])
def test_stop_signal_before_the_supervisor_loads_requeues(sig):
    """`batchgen run` spends seconds importing the supervisor (torch) before its handlers are
    installed: the early handlers make a stop signal then exit 75 too, not a signal death a
    requeueing wrapper would take for a failure."""
    code = ("import os, signal, time\n"
            "from batchgen.runner.exits import requeue_on_stop_signals\n"
            "requeue_on_stop_signals()\n"
            f"os.kill(os.getpid(), signal.{sig})\n"
            "time.sleep(30)\n")
    done = _python(code, timeout=60)
    assert done.returncode == 75


@pytest.mark.parametrize("announce", [True, False])
def test_an_early_stop_says_so_where_a_person_started_the_run(announce):
    """Ctrl-C while `batchgen run` still loads: one line says nothing was run and what to do,
    not a silent exit; a worker (announce False) leaves the words to its supervisor."""
    code = ("import os, signal, time\n"
            "from batchgen.runner.exits import requeue_on_stop_signals\n"
            f"requeue_on_stop_signals(announce={announce})\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    done = _python(code, timeout=60)
    assert done.returncode == 75
    said = "stopped by SIGINT before the job started: nothing was run; re-run the same command"
    assert (said in done.stderr) == announce and (done.stderr == "") != announce, done.stderr


def test_entry_point_catches_stop_signals_before_loading_the_command_line():
    """The `batchgen` entry point installs the early handlers for `run` before it imports the
    command line (~0.5 s of imports), and only for `run`."""
    code = ("import builtins, signal, sys\n"
            "sys.argv = ['batchgen', *sys.argv[1:]]\n"
            "real_import = builtins.__import__\n"
            "def spy(name, *args, **kwargs):\n"
            "    if name == 'batchgen.cli':\n"
            "        print('caught' if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL\n"
            "              else 'default', flush=True)\n"
            "    return real_import(name, *args, **kwargs)\n"
            "builtins.__import__ = spy\n"
            "from batchgen.__main__ import main\n"
            "main()\n")
    run_help = _python(code, "run", "--help")
    assert run_help.returncode == 0 and run_help.stdout.startswith("caught"), run_help.stdout
    status = _python(code, "status", "--help")
    assert status.returncode == 0 and status.stdout.startswith("default"), status.stdout


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_worker_stopped_while_importing_torch_requeues_quietly(sig):
    """A worker spends seconds importing torch before its own handlers exist; Ctrl-C (SIGINT
    to the terminal's whole process group) or a SIGTERM then must exit 75 without a
    traceback. The signal is sent from inside the first `import torch`."""
    code = ("import builtins, os, signal, sys, time\n"
            "sys.argv = ['worker_entry', '/nonexistent/spec.json']\n"
            "real_import = builtins.__import__\n"
            "def spy(name, *args, **kwargs):\n"
            "    if name == 'torch':\n"
            f"        os.kill(os.getpid(), signal.{sig})\n"
            "        time.sleep(5)\n"
            "    return real_import(name, *args, **kwargs)\n"
            "builtins.__import__ = spy\n"
            "import runpy\n"
            "runpy.run_module('batchgen.runner.worker.worker_entry', run_name='__main__')\n")
    done = _python(code)
    assert done.returncode == 75, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr


def test_stop_signal_after_the_job_completed_keeps_exit_zero():
    """Once "completed" is on record a stop signal no longer turns the exit into 75 (a
    requeue would only find the job done); before that it raises Preempted (exit 75)."""
    from batchgen.runner.exits import Preempted, StopSignals

    stops = StopSignals()
    stops.install()
    try:
        with pytest.raises(Preempted):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)
        stops.stopping, stops.completed = False, True
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        assert stops.stopping  # seen, and nothing raised
    finally:
        stops.restore()


def test_supervisor_handlers_leave_the_decided_exit_code_alone():
    """After run_job, the entry point's early handlers (exit 75) are not put back: the exit
    code is decided, and a signal arriving before the process exits must not requeue a job
    that completed. Handlers installed by anyone else are restored as they were."""
    from batchgen.runner.exits import STOP_SIGNALS, StopSignals, requeue_on_stop_signals

    before = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in STOP_SIGNALS)}
    try:
        requeue_on_stop_signals()
        signal.signal(signal.SIGUSR1, before[signal.SIGUSR1])  # someone else's handler
        stops = StopSignals()
        stops.install()
        stops.restore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) is before[signal.SIGUSR1]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # still here: ignored
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_entry_point_keeps_the_exit_code_through_teardown():
    """Once `batchgen run` has decided its exit code, a stop signal during what is left of the
    exit (threads joined, atexit functions, flushes) must not turn it into a signal death; the
    atexit functions still run and the process leaves with the decided code."""
    code = ("import atexit, os, signal, sys, time\n"
            "sys.argv = ['batchgen', 'run', '--help']\n"
            "def late():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.3)\n"
            "    print('alive', flush=True)\n"
            "atexit.register(late)\n"
            "from batchgen.__main__ import main\n"
            "main()\n"
            "print('main returned', flush=True)\n")
    done = _python(code)
    assert done.returncode == 0 and done.stdout.endswith("alive\n"), (done.returncode,
                                                                      done.stdout[-500:])
    assert "main returned" not in done.stdout  # it left without the interpreter's teardown


def test_leaving_without_teardown_keeps_what_a_normal_exit_delivers(tmp_path):
    """exit_without_teardown: a non-daemon thread finishes, buffered output and log records
    reach their files, atexit functions run, and the code is the one given."""
    log_file = tmp_path / "log.txt"
    code = ("import atexit, logging, sys, threading, time\n"
            "from batchgen.runner.exits import exit_without_teardown\n"
            f"logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)\n"
            "def slow():\n"
            "    time.sleep(0.3)\n"
            "    sys.stdout.write('thread done\\n')\n"
            "threading.Thread(target=slow).start()\n"
            "atexit.register(lambda: sys.stdout.write('atexit ran\\n'))\n"
            "logging.getLogger('x').info('logged')\n"
            "sys.stdout.write('buffered')\n"
            "exit_without_teardown(7)\n")
    done = _python(code)
    assert done.returncode == 7, done.stderr[-2000:]
    assert done.stdout == "bufferedthread done\natexit ran\n"
    assert "logged" in log_file.read_text()
