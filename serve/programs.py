"""Compiled programs under a budget: what each one costs, how many the process may hold.

Why a budget: on the CPU, XLA's JIT maps the code and data of every compiled kernel
separately (about three mappings per fusion, llvm-project#63236), so one step program of the
embedded default (about 1,000 fusions) adds about 1,000 memory mappings and 50-90 MB. Past
``vm.max_map_count`` (65,530 on a stock kernel) mmap fails and the process dies inside the JIT.
The figures per program, on CPU and H200: bench/RESULTS.md ("Compiled programs").

``ProgramCache`` holds ahead-of-time compiled programs under the caller's keys and drops the
least recently used one when a new one would pass the budget. Each key gets a fresh
``jax.jit``, so the ``Compiled`` it keeps is the only owner of the executable: dropping it
returns its mappings (a module-level jit would keep every shape it ever compiled). A program
compiled again comes from JAX's persistent cache, in a fifth of the time.

``ProgramBudget`` reads the limits once (``vm.max_map_count``, MemAvailable) and measures the
cost of each compile (mappings and RSS it added, running maximum), so ``capacity`` is the
number of programs that keep the process under a quarter of the map limit and half the memory
it started with. Fewer than ``MIN_PROGRAMS`` (two steps in flight, two programs each) is a
configuration error. One cache serves the process, since the limits are the process's.

``compile_ahead`` builds a set of programs before their first call, several at a time
(``compile_threads``): tracing and lowering hold the GIL, one program after another, but XLA's
compiles run side by side: at V4.1-Flash depth one step program takes 87-112 s to compile on
an H100 host (bench/RESULTS.md). ``compile_s`` counts wall time. On the CPU one at a time: the
budget measures each compile's mappings, which side by side it could not.
"""
from __future__ import annotations

import gc
import logging
import os
import resource
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable

import jax

MIN_PROGRAMS = 4
MAP_SHARE = 0.25  # of vm.max_map_count: libraries, threads and the allocator need the rest
MEMORY_SHARE = 0.5  # of the memory available at start-up


class BudgetError(ValueError):
    """The configuration needs more compiled programs than the process can hold."""


def _read_int(path: str, default: int | None) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def process_maps(pid: int | str = "self") -> int | None:
    """A process's memory mappings now (None where the OS does not say, or it has gone)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


class Peak(threading.Thread):
    """The largest value ``probe()`` gave while watched (sampled every ``every`` s; None ends
    the watch): for the benchmarks and the test that hold the budget to its promise."""

    def __init__(self, probe, every: float = 0.1):
        super().__init__(daemon=True)
        self.probe, self.every, self.peak, self._done = probe, every, 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.is_set():
            value = self.probe()
            if value is None:
                return
            self.peak = max(self.peak, value)
            self._done.wait(self.every)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


class PeakMaps(Peak):
    """The most mappings process ``pid`` had while watched."""

    def __init__(self, pid: int | str = "self", every: float = 0.1):
        super().__init__(lambda: process_maps(pid), every)


def process_rss() -> int:
    """Resident bytes now (the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class ProgramBudget:
    """How many compiled programs the process may hold (see the module docstring)."""

    map_limit: int | None  # vm.max_map_count; None where there is none
    memory: int | None  # bytes available at start-up
    max_programs: int | None = None  # the user's cap (--max-compiled-programs)
    base_maps: int = 0  # mappings before the first program
    map_cost: int = 0  # the most mappings one program added
    rss_cost: int = 0  # the most RSS one program added

    @classmethod
    def detect(cls) -> "ProgramBudget":
        maps = process_maps()
        return cls(None if maps is None else _read_int("/proc/sys/vm/max_map_count", 65530), _mem_available(),
                   base_maps=maps or 0)

    def cap(self, max_programs: int | None) -> None:
        """The user's cap (None: as many as fit)."""
        if max_programs is not None and max_programs < MIN_PROGRAMS:
            raise BudgetError(f"--max-compiled-programs {max_programs} is below the {MIN_PROGRAMS} programs two "
                              f"steps in flight need")
        self.max_programs = max_programs

    @property
    def map_ceiling(self) -> int | None:
        return None if self.map_limit is None else int(self.map_limit * MAP_SHARE)

    def fit(self) -> int | None:
        """Programs that fit the limits at the costs measured so far (None: nothing to go by)."""
        fits = []
        if self.map_ceiling is not None and self.map_cost:
            fits.append((self.map_ceiling - self.base_maps) // self.map_cost)
        if self.memory is not None and self.rss_cost:
            fits.append(int(self.memory * MEMORY_SHARE) // self.rss_cost)
        return min(fits) if fits else None

    def capacity(self) -> int | None:
        """How many programs to hold: the user's cap within what fits, never below MIN_PROGRAMS."""
        held = [n for n in (self.fit(), self.max_programs) if n is not None]
        return max(min(held), MIN_PROGRAMS) if held else None

    def check(self) -> None:
        """BudgetError, naming what to change, where the configuration cannot fit."""
        fit = self.fit()
        if fit is None:
            return
        cost = f"{self.map_cost} mappings and {self.rss_cost >> 20} MB a program"
        if fit < MIN_PROGRAMS:
            raise BudgetError(f"only {fit} compiled programs of this model ({cost}) fit under {self.limits()}, "
                              f"and serving needs {MIN_PROGRAMS}: raise vm.max_map_count (sysctl) or free memory")
        if self.max_programs is not None and self.max_programs > fit:
            raise BudgetError(f"--max-compiled-programs {self.max_programs} does not fit: at {cost}, {fit} fit "
                              f"under {self.limits()}; lower --max-compiled-programs")

    def limits(self) -> str:
        parts = [] if self.map_limit is None else [f"a quarter of vm.max_map_count={self.map_limit}"]
        if self.memory is not None:
            parts.append(f"half of the {self.memory >> 20} MB available")
        return " and ".join(parts)

    def describe(self) -> dict:
        return {"max_map_count": self.map_limit, "map_ceiling": self.map_ceiling, "memory_mb": (self.memory or 0) >> 20,
                "base_maps": self.base_maps, "maps_per_program": self.map_cost,
                "rss_mb_per_program": round(self.rss_cost / 2**20, 1), "capacity": self.capacity()}


@dataclass
class ProgramCache:
    """Compiled programs by key, least recently used out first (see the module docstring)."""

    budget: ProgramBudget = field(default_factory=ProgramBudget.detect)
    compiles: int = 0
    evictions: int = 0
    compile_s: float = 0.0
    compile_log: deque = field(default_factory=lambda: deque(maxlen=64))   # (key, seconds): the latest compiles
    _held: OrderedDict = field(default_factory=OrderedDict)

    def run(self, key: Hashable, fn: Callable, args: tuple, statics: dict | None = None,
            donate: tuple[int, ...] = ()) -> Any:
        """``fn(*args, **statics)`` through the program compiled for ``key``; the caller
        promises that ``key`` fixes the statics and the shapes and dtypes of ``args``."""
        program = self._held.get(key)
        if program is None:
            program = self._compile(key, fn, args, statics or {}, donate)
        else:
            self._held.move_to_end(key)
        return program(*args)

    def compile_ahead(self, jobs: list, threads: int) -> None:
        """Compile ``jobs`` (``(key, fn, args, statics, donate)``, each as ``run`` takes it) now,
        ``threads`` at a time (the module docstring); keys held already, or past the budget's
        capacity, are left to ``run``."""
        capacity = self.budget.capacity()
        todo = list({job[0]: job for job in jobs if job[0] not in self._held}.values())
        if capacity is not None:
            todo = todo[:max(0, capacity - len(self._held))]
        if threads <= 1 or len(todo) <= 1 or any(_cpu_int4_on_mesh(job[2]) for job in todo):
            for key, fn, args, statics, donate in todo:
                self._compile(key, fn, args, statics, donate)
            return
        lowered = []
        for key, fn, args, statics, donate in todo:
            t0 = time.perf_counter()
            lowered.append((key, _jitted(fn, statics, donate).lower(*args), time.perf_counter() - t0))

        def build(item):
            key, low, seconds = item
            t0 = time.perf_counter()
            return key, low.compile(), seconds + time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            for key, program, seconds in pool.map(build, lowered):
                self._held[key] = program
                self._logged(key, seconds)
        wall = time.perf_counter() - t0
        self.compile_s += wall + sum(seconds for *_, seconds in lowered)   # the wall time, not the threads' sum
        logging.getLogger("megajax").info("compiled %d programs, %d at a time, in %.1f s", len(lowered), threads, wall)

    def _logged(self, key, seconds: float) -> None:
        self.compile_log.append((_label(key), round(seconds, 2)))
        logging.getLogger("megajax").info("compiled %s in %.1f s", *self.compile_log[-1])
        self.compiles += 1

    def _compile(self, key, fn, args, statics, donate):
        self._make_room()
        maps0, rss0, t0 = process_maps(), process_rss(), time.perf_counter()
        jitted = _jitted(fn, statics, donate)
        program = jitted.lower(*args).compile()
        if _cpu_int4_on_mesh(args):
            program = jitted   # (its first call takes this compile from the persistent cache)
        self.compile_s += time.perf_counter() - t0
        self._logged(key, time.perf_counter() - t0)
        b = self.budget
        if maps0 is not None:
            if self.compiles == 1:
                b.base_maps = maps0
            b.map_cost = max(b.map_cost, process_maps() - maps0)
        if self.compiles > 1:  # the first compile also sets up the compiler itself (~300 MB)
            b.rss_cost = max(b.rss_cost, process_rss() - rss0)
        self._held[key] = program
        return program

    def _make_room(self) -> None:
        """Evict until one more program fits the capacity and the live map count."""
        capacity, ceiling = self.budget.capacity(), self.budget.map_ceiling
        while self._held and capacity is not None and len(self._held) >= capacity:
            self._evict()
        if ceiling is None or not self.budget.map_cost:
            return
        while len(self._held) > MIN_PROGRAMS and process_maps() + self.budget.map_cost > ceiling:
            self._evict()

    def _evict(self) -> None:
        self._held.popitem(last=False)
        self.evictions += 1
        gc.collect()  # the executable's mappings go with the last reference

    def held(self) -> list:
        """The keys held, least recently used first."""
        return list(self._held)

    def clear(self) -> None:
        self._held.clear()

    def info(self) -> dict:
        return {"held": len(self._held), "compiles": self.compiles, "evictions": self.evictions,
                "compile_s": round(self.compile_s, 1), **self.budget.describe()}


def _label(key: Hashable) -> str:
    """A short name of a program key: its strings and numbers, and an input layout's first
    shape (the step's token count)."""
    if not isinstance(key, tuple):
        return str(key)
    parts = []
    for k in key:
        if isinstance(k, (str, int)):
            parts.append(str(k))
        elif isinstance(k, tuple) and len(k) == 2 and isinstance(k[1], tuple) and k[1] and isinstance(k[1][0], tuple):
            parts.append(f"tokens={k[1][0][0][0]}")
    return " ".join(parts)


_SHARED: ProgramCache | None = None


def shared_programs() -> ProgramCache:
    """The process's program cache (created on first use)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = ProgramCache()
    return _SHARED


def _cpu_int4_on_mesh(args) -> bool:
    """Whether ``args`` hold int4 arrays (MXFP4 expert codes) on a CPU mesh: JAX's CPU arrays
    keep int4 one to a byte, yet a program compiled ahead of time for a mesh asks for them packed
    and refuses them at the call (JAX 0.10); the jit's own dispatch takes them."""
    return jax.default_backend() == "cpu" and any(
        getattr(x, "dtype", None) == jax.numpy.int4 and isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
        for x in jax.tree.leaves(args))


def _jitted(fn, statics: dict, donate: tuple[int, ...]):
    """``fn`` with its static arguments bound, jitted as every program of the cache is."""
    return jax.jit(partial(fn, **statics), donate_argnums=donate)


def compile_threads() -> int:
    """Programs ``compile_ahead`` builds at a time: on a GPU host half its cores, up to 8 (a first
    choice, not measured); on the CPU one (the compiles share the cores the steps run on, and the
    budget measures each)."""
    if jax.default_backend() == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))
