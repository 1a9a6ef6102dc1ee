"""The exit codes of every hsx command, and what a scheduler (Slurm, a Kubernetes Job, a shell
loop) should do with each: the contract, in one place. Every command returns one of these.

| code | name | meaning | a scheduler |
| --- | --- | --- | --- |
| 0 | DONE | the job is done (`produce`: every batch is published; a one-shot command: it succeeded) | do not run it again |
| 1 | CRASHED | an uncaught exception, a bug (Python's own code for it) | retry a few times, then report it |
| 2 | BAD_INPUT | bad input or configuration, named in one `hsx: error:` line | never retry: fix the input |
| 3 | DEVICE_FAILED | the consumer's device failed (the CUDA context is dead) | restart it, on another GPU or node if it fails again |
| 65 | JOB_FAILED | the job failed: everything left is dead-lettered (or a check found problems) | do not retry blindly: read the dead letters |
| 75 | STOPPED | stopped before the job was done (SIGTERM, SIGINT, preemption, a timeout); safe to run again | run it again: it resumes |

65 is sysexits' EX_DATAERR, 75 its EX_TEMPFAIL. A process killed by a signal it does not handle
(SIGKILL: the OOM killer, a scheduler's last resort) is the shell's 128 + the signal, or a
negative return code from `subprocess`; it too is safe to run again, as every hsx worker acks
only what is durable.

This module knows nothing of processes or signals; the commands decide which code applies.
"""

import enum


class ExitCode(enum.IntEnum):
    DONE = 0
    CRASHED = 1
    BAD_INPUT = 2
    DEVICE_FAILED = 3
    JOB_FAILED = 65
    STOPPED = 75


DONE = ExitCode.DONE
CRASHED = ExitCode.CRASHED
BAD_INPUT = ExitCode.BAD_INPUT
DEVICE_FAILED = ExitCode.DEVICE_FAILED
JOB_FAILED = ExitCode.JOB_FAILED
STOPPED = ExitCode.STOPPED

# What each code tells a scheduler, as `hsx --help` and the reference's table say it.
MEANING: dict[ExitCode, tuple[str, str]] = {
    DONE: ("the job is done (produce: published)", "do not run it again"),
    CRASHED: ("an uncaught exception (a bug)", "retry a few times, then report it"),
    BAD_INPUT: ("bad input or configuration", "never retry: fix it"),
    DEVICE_FAILED: ("the consumer's device failed", "restart it, elsewhere if it fails again"),
    JOB_FAILED: ("the job failed: everything left is dead-lettered", "do not retry blindly"),
    STOPPED: ("stopped before the job was done (a signal, a timeout)", "run it again: it resumes"),
}


def epilog() -> str:
    """The codes as the CLI's help lists them."""
    lines = ['exit codes (docs/reference/commands.md, "Exit codes"):']
    lines += [f"  {int(code):>3}  {meaning}; {then}" for code, (meaning, then) in MEANING.items()]
    return "\n".join(lines)


def of_child(code: int | None) -> ExitCode:
    """The code a supervisor (`hsx up`) exits with for a child that ended with `code`: the child's
    own where it is one of the contract's that means the same for the whole run (bad input, a
    failed device, a failed job, a stop), else CRASHED (a crash, or a signal that killed it)."""
    if code in (BAD_INPUT, DEVICE_FAILED, JOB_FAILED, STOPPED):
        return ExitCode(code)
    return CRASHED
