"""Launch the CPU test workload (native gh_workload over the fake NCCL) as a multi-process job.

Tests and demos need a real multi-process "training job" whose ranks rendezvous, slow each other
down and hang like NCCL ranks do, without GPUs. This module starts one process per rank, wires the
fake libraries and an optional LD_PRELOAD hook, and changes faults while the job runs. All rank
processes share one process group, which is killed on exit, on error and at interpreter exit, so a
hung job never outlives its test.

As on a GPU, each rank's host launches its iteration's device work (compute kernels, then the
collectives) asynchronously and synchronises once per iteration: host times (IterTimes.start_ns,
compute_end_ns, end_ns) say when the host launched and waited, device times (gpu_arrive_ns,
gpu_done_ns) when the rank's GPU reached its collectives and finished them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_REPO = Path(__file__).resolve().parent.parent
_OUTPUTS = ("gh_workload", "gh_workload_static", "libghworkload.so", "fake/libnccl.so.2",
            "fake/libcudart.so.12", "fake/libcuda.so.1", "fake/libcublas.so.12",
            "fake/libnvidia-ml.so.1")


@dataclass(frozen=True)
class FakeJobSpec:
    """What the workload does; maps one-to-one onto its GH_* environment variables."""

    world_size: int
    iters: int
    compute_ms: float
    bytes: int = 1 << 20
    tp: int = 1
    pp: int = 1
    job_id: str = "fakejob"
    ckpt_every: int = 0
    ckpt_ms: float = 0.0
    # compute_ms is device time (kernels on the fake GPU, which sleep). compute_busy is the host's
    # real CPU work (SGEMMs) to launch them, as a share of compute_ms: real work is the point, but
    # many ranks busy on a 2-core CI machine turn scheduler delays into ms of timing noise.
    compute_busy: float = 0.1
    verbose: bool = True  # one line per iteration in rank<N>.out: progress and timing for tests
    kernels: int = 4  # compute_ms is launched as this many kernels
    launch_us: float | None = None  # host cost of every launch instead of compute_busy's share
    # The executable in native/build: gh_workload_static has the CUDA runtime compiled in (nvcc's
    # default), so its process has no libcudart, only the driver (libcuda.so.1).
    workload: str = "gh_workload"
    # DP collectives per iteration, per pipeline stage (the last repeats): stages whose DP
    # communicators advance at different rates, as Megatron's buckets make them.
    dp_buckets: tuple[int, ...] = (1,)
    # The DP step as one coalesced reduce-scatter (a group of one reduce-scatter per bucket): the
    # DP communicator is then used only inside groups, as the pipeline's batched send/recv is.
    dp_grouped: bool = False
    # The process group's collective timeout: the workload's model of PyTorch's watchdog aborts
    # a rank whose collective has not completed on its GPU this long after it was issued.
    pg_timeout_s: float | None = None
    # The ranks report that timeout to the hook (GREYHOUND_PG_TIMEOUT_S), as the PyTorch
    # integration does.
    report_pg_timeout: bool = True


@dataclass(frozen=True)
class IterTimes:
    """One iteration of one rank, CLOCK_MONOTONIC ns (comparable with time.monotonic_ns()).

    Host: start_ns (iteration start), compute_end_ns (all device work launched: the host enters
    its synchronisation), end_ns (the synchronisation returned), collective_ns (the host is about
    to launch the iteration's first collective). Device, from CUDA events anchored at the
    iteration's start: gpu_arrive_ns (the GPU reached the collectives, i.e. ended its compute),
    gpu_done_ns (the DP all-reduce completed); 0 when the events gave no time.
    """

    it: int
    start_ns: int
    compute_end_ns: int
    end_ns: int
    gpu_arrive_ns: int = 0
    gpu_done_ns: int = 0
    collective_ns: int = 0

    @property
    def comm_ms(self) -> float:
        """Host time blocked in the iteration's synchronisation."""
        return (self.end_ns - self.compute_end_ns) / 1e6

    @property
    def total_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def gpu_comm_ms(self) -> float:
        """Device time from reaching the collectives to the end of the DP all-reduce: the
        transfers plus the wait for the rank's peers."""
        return (self.gpu_done_ns - self.gpu_arrive_ns) / 1e6


_MAKE_FAKES = ["make", "-s", "-C", str(_REPO / "native"), "-f", "fake/fake.mk",
               "-f", "workload/workload.mk", "all-fake"]


def _stale(build: Path) -> bool:
    """Outputs missing, or make says they are out of date (no make at all: take them as built)."""
    if not all((build / p).exists() for p in _OUTPUTS):
        return True
    try:
        return subprocess.run([*_MAKE_FAKES[:2], "-q", *_MAKE_FAKES[2:]], capture_output=True,
                              check=False).returncode != 0
    except FileNotFoundError:
        return False


def native_build_dir() -> Path:
    """<repo>/native/build, (re)built when missing or older than its sources; a file lock keeps
    parallel callers from racing."""
    build = _REPO / "native" / "build"
    if not _stale(build):
        return build
    build.mkdir(parents=True, exist_ok=True)
    with open(build / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (_REPO / "native" / "Makefile").exists():
            # The whole tree (hook too); a broken hook build must not block the fakes below.
            subprocess.run(["make", "-s", "-C", str(_REPO / "native")], check=False)
        if _stale(build):
            subprocess.run(_MAKE_FAKES, check=True)
    return build


class FaultFile:
    """The fault file the fake libraries watch. Each write replaces the file atomically (new
    inode), so a reader never sees half a line and notices the change within a millisecond."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._write()

    def set(self, line: str) -> None:
        norm = " ".join(line.split())
        with self._lock:
            if norm not in self._lines:
                self._lines.append(norm)
            self._write()

    def clear(self, line: str | None = None) -> None:
        """Remove one fault line, or all of them when line is None."""
        with self._lock:
            if line is None:
                self._lines.clear()
            else:
                norm = " ".join(line.split())
                self._lines = [x for x in self._lines if x != norm]
            self._write()

    @property
    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(f"{x}\n" for x in self._lines))
        os.replace(tmp, self.path)


def _kill_group(pgid: int, procs: list[subprocess.Popen[bytes]]) -> None:
    if any(p.poll() is None for p in procs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


class FakeJob:
    """world_size processes of gh_workload; use as a context manager (starts on enter, kills on
    exit). Rank r writes stdout to workdir/rank<r>.out and stderr to workdir/rank<r>.err."""

    def __init__(
        self,
        spec: FakeJobSpec,
        *,
        workdir: Path,
        hook: Path | None,
        shm_dir: Path | None,
        env: Mapping[str, str] | None = None,
        shm_dir_of_rank: Mapping[int, Path] | None = None,
    ) -> None:
        if spec.world_size < 1 or spec.world_size % (spec.tp * spec.pp) != 0:
            raise ValueError("world_size must be a positive multiple of tp * pp")
        if spec.kernels < 1:
            raise ValueError("kernels must be >= 1")
        if not spec.dp_buckets or min(spec.dp_buckets) < 1:
            raise ValueError("dp_buckets must be one or more counts >= 1")
        if spec.pg_timeout_s is not None and spec.pg_timeout_s <= 0:
            raise ValueError("pg_timeout_s must be > 0")
        self.spec = spec
        self.workdir = workdir
        self.hook = hook
        self.shm_dir = shm_dir
        # ranks whose rings go elsewhere (another "node": another agent's directory)
        self.shm_dir_of_rank = dict(shm_dir_of_rank or {})
        self._extra_env = dict(env or {})
        workdir.mkdir(parents=True, exist_ok=True)
        self.faults = FaultFile(workdir / "faults.txt")
        self.procs: list[subprocess.Popen[bytes]] = []
        self._finalizer: weakref.finalize[[int, list[subprocess.Popen[bytes]]], FakeJob] | None = None

    def rank_env(self, rank: int, build: Path) -> dict[str, str]:
        s = self.spec
        env = dict(os.environ)
        env.update(self._extra_env)
        lib = str(build / "fake")
        old = env.get("LD_LIBRARY_PATH")
        env.update(
            RANK=str(rank), WORLD_SIZE=str(s.world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(s.world_size), GH_ITERS=str(s.iters),
            GH_COMPUTE_MS=str(s.compute_ms), GH_COMPUTE_BUSY=str(s.compute_busy),
            GH_KERNELS=str(s.kernels), GH_BYTES=str(s.bytes), GH_TP=str(s.tp), GH_PP=str(s.pp),
            GH_CKPT_EVERY=str(s.ckpt_every), GH_CKPT_MS=str(s.ckpt_ms),
            GH_VERBOSE="1" if s.verbose else "0", GH_RDZV=str(self.workdir / "rdzv"),
            FAKE_NCCL_FAULTS=str(self.faults.path), GREYHOUND_JOB_ID=s.job_id,
            # The fake "GPU" runs GEMMs at a fixed rate (see native/fake/cublas.c), so GEMM
            # checks on shared CPU cores measure it rather than the scheduler.
            FAKE_GPU_GFLOPS=env.get("FAKE_GPU_GFLOPS", "0.5"),
            LD_LIBRARY_PATH=f"{lib}:{old}" if old else lib,
        )
        if s.launch_us is not None:
            env["GH_LAUNCH_US"] = str(s.launch_us)
        env["GH_DP_BUCKETS"] = ",".join(map(str, s.dp_buckets))
        env["GH_DP_GROUPED"] = "1" if s.dp_grouped else "0"
        if s.pg_timeout_s is not None:
            env["GH_PG_TIMEOUT_MS"] = str(round(s.pg_timeout_s * 1000))
            if s.report_pg_timeout:
                env["GREYHOUND_PG_TIMEOUT_S"] = f"{s.pg_timeout_s:g}"
        if s.pg_timeout_s is None or not s.report_pg_timeout:
            env.pop("GREYHOUND_PG_TIMEOUT_S", None)
        shm = self.shm_dir_of_rank.get(rank, self.shm_dir)
        if shm is not None:
            env["GREYHOUND_SHM_DIR"] = str(shm)
        if self.hook is not None:
            env["LD_PRELOAD"] = str(self.hook)
        return env

    def start(self) -> None:
        if self.procs:
            raise RuntimeError("job already started")
        build = native_build_dir()
        stale = self.workdir / "rdzv" / "nccl_id"
        stale.unlink(missing_ok=True)
        try:
            pgid = 0
            for rank in range(self.spec.world_size):
                with open(self.workdir / f"rank{rank}.out", "wb") as out, \
                        open(self.workdir / f"rank{rank}.err", "wb") as err:
                    p = subprocess.Popen(
                        [str(build / self.spec.workload)], env=self.rank_env(rank, build),
                        stdout=out, stderr=err, stdin=subprocess.DEVNULL, process_group=pgid,
                    )
                self.procs.append(p)
                pgid = pgid or p.pid
                if self._finalizer is None:
                    self._finalizer = weakref.finalize(self, _kill_group, p.pid, self.procs)
        except BaseException:
            self.kill()
            raise

    def wait(self, timeout: float) -> list[int]:
        """Exit codes by rank; raises TimeoutError if any rank still runs after timeout seconds
        (the job is left running: call kill())."""
        deadline = time.monotonic() + timeout
        codes: list[int] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired as e:
                raise TimeoutError(f"fake job still running after {timeout}s") from e
        return codes

    def kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def iterations(self, rank: int) -> list[IterTimes]:
        """Iterations rank has finished so far (needs spec.verbose)."""
        path = self.workdir / f"rank{rank}.out"
        out: list[IterTimes] = []
        if not path.exists():
            return out
        # The rank writes while this reads: only lines it has finished (newline-terminated) count;
        # a half-written last one ("it=7 t0=..." without t1) is read on the next call.
        text = path.read_text()
        for line in text[:text.rfind("\n") + 1].splitlines():
            if not line.startswith("it="):
                continue
            f = dict(kv.split("=", 1) for kv in line.split())
            out.append(IterTimes(int(f["it"]), int(f["t0"]), int(f["t1"]), int(f["t2"]),
                                 int(f.get("ga", 0)), int(f.get("gd", 0)), int(f.get("tc", 0))))
        return out

    def wait_iteration(self, rank: int, it: int, timeout: float) -> None:
        """Block until rank has finished iteration it; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.iterations(rank)
            if done and done[-1].it >= it:
                return
            if not self.running():
                break
            time.sleep(0.01)
        raise TimeoutError(f"rank {rank} did not reach iteration {it}")

    def __enter__(self) -> FakeJob:
        if not self.procs:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
