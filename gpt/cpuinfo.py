"""What CPU this is, read from /proc/cpuinfo: its model name (for the figures benchmarks print) and instruction-set
extensions (for gpt/kernels.py's choice)."""

import functools


def cpuinfo_field(*keys):
    """The first value of any of keys in /proc/cpuinfo, or None where there is no such file (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() in keys), None)
    except OSError:
        return None


def cpu_name():
    """The CPU's model name as lscpu shows it ("AMD EPYC ...", "Intel(R) Xeon(R) ..."), else the platform's word."""
    import platform
    return cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


@functools.cache  # read once a process: kernels.json's key and gpt/avx2.py's check read them
def cpu_flags():
    """The CPU's instruction-set extensions (x86's "flags", Arm's "Features"), in their order; () where they cannot be
    read."""
    return tuple((cpuinfo_field("flags", "Features") or "").split())
