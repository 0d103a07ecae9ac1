"""ScienceWorld's simulator, pooled: a few JVMs, each holding many worlds, shared by every game
of this process.

The simulator is the `scienceworld` package's: its jar, started by its `ScienceWorldEnv` (a JVM
and a py4j gateway to it). One JVM holds many worlds at once: each world is one of the jar's
`PythonInterface` objects, with its own loaded task, and two worlds of one JVM interleave their
steps exactly as two JVMs would (checked against playing them one after the other). A world
costs about 10 MB of the JVM's heap and a JVM about 1.5 s to start, so a game takes a world, not
a JVM: `simulators` JVMs of `worlds` worlds each hold that many games at once.

Steps go straight to the jar's own calls (step, score, completed). The package's `step` also
lists every valid action, looks around and reads the inventory after each step, which took about
40 times the step itself (bench/scienceworld_sim.py measures both); a policy that wants the
valid actions asks for them (`Episode.valid_actions`).

A game more than the pool holds, or one whose JVM died, gets a world back by replay: the task is
loaded afresh and the game's actions played again. The simulator is deterministic given the
task, the variation and the actions (a few listings, "look in" and "look at", may name the same
things in another order); a replay whose score differs from the one logged stops with
ReplayDiverged rather than carry on from another state.

Failures:
- no Java: SimulatorUnavailable (models.base.BackendUnavailable, so the CLI ends in one `error:`
  line) naming what to install, before any JVM is tried;
- a JVM that dies, or a call that outlasts `call_timeout` (the JVM is then killed, so a hang
  becomes a death): its worlds' games replay on another JVM and the step is tried again, up to
  `restarts` times an episode; past that SimulatorCrashed, naming the task, the turn and why.
Every JVM is closed (and waited for, so none is left behind, not even as a zombie) by `close()`,
by `close_all()` and at interpreter exit; py4j's die-on-broken-pipe ends any JVM whose Python
process died without closing it.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from models.base import BackendUnavailable

# What a Debian machine installs for the simulator (the CI script installs it the same way).
JAVA_INSTALL = "apt-get install default-jre-headless"


class SimulatorUnavailable(BackendUnavailable):
    """The simulator cannot start: no Java runtime, or one that cannot run the jar."""


class SimulatorCrashed(BackendUnavailable):
    """A JVM died or hung mid-episode more often than the episode may restart."""


class ReplayDiverged(RuntimeError):
    """A replayed game reached another score than it had logged: its state cannot be restored."""


def find_java() -> str:
    """The java executable the simulator starts: $JAVA_HOME/bin/java when JAVA_HOME holds one
    (py4j's own rule), else `java` on PATH; SimulatorUnavailable saying what to install."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    found = shutil.which("java")
    if found:
        return found
    where = f"JAVA_HOME={home} has no bin/java, and " if home else ""
    raise SimulatorUnavailable(
        f"ScienceWorld's simulator needs a Java runtime: {where}no `java` is on PATH. Install one "
        f"(Debian/Ubuntu: {JAVA_INSTALL}) or set JAVA_HOME to a JDK/JRE 11 or newer"
    )


@dataclass(frozen=True)
class Settings:
    """How the pool runs its JVMs (the environment's options of the same names)."""

    simplifications: str = "easy"
    simulators: int = 1  # JVMs
    worlds: int = 64  # worlds per JVM: games held at once without replay
    call_timeout: float = 60.0  # seconds a simulator call may take before its JVM is killed
    restarts: int = 2  # JVM deaths an episode survives by replay

    @property
    def heap_mb(self) -> int:
        """The JVM's -Xmx: ~10 MB a loaded world (measured: 150 worlds held 1.6 GB), with room."""
        return 256 + 16 * self.worlds


class World(Protocol):
    """One loaded task in a simulator. Calls raise SimulatorCrashed when its JVM died or hung."""

    alive: bool

    def load(self, task_type: str, variation: int, simplifications: str, gold: bool) -> None: ...
    def step(self, action: str) -> tuple[str, int, bool]:
        """(observation, score 0-100 or negative on a failed task, completed)."""
    def task_description(self) -> str: ...
    def gold_path(self) -> list[str]: ...
    def valid_actions(self) -> list[str]: ...


class Backend(Protocol):
    """Where worlds come from: JVMs (JvmBackend), or a recording for tests (record.Recorded)."""

    capacity: int

    def new_world(self) -> World: ...
    def close(self) -> None: ...


# ---- the JVMs ----


class Jvm:
    """One simulator process: the package's ScienceWorldEnv (JVM, py4j gateway), started with
    `java` and a heap of `heap_mb`. `call` runs one simulator call under a watchdog that kills
    the JVM past `timeout` seconds, so a hung simulator surfaces as a death, never a hang."""

    _launch = threading.Lock()  # the launch reads os.environ, which it sets for the child

    def __init__(self, java: str, heap_mb: int, timeout: float):
        from scienceworld import ScienceWorldEnv

        self.timeout, self.dead, self.worlds = timeout, False, 0
        # ScienceWorldEnv starts `java` from PATH with no JVM options: the child's PATH and
        # JAVA_TOOL_OPTIONS are set for the launch and restored after it.
        saved = {k: os.environ.get(k) for k in ("PATH", "JAVA_TOOL_OPTIONS")}
        with Jvm._launch:
            try:
                os.environ["PATH"] = os.pathsep.join([os.path.dirname(java), saved["PATH"] or ""])
                os.environ["JAVA_TOOL_OPTIONS"] = " ".join(filter(None, [saved["JAVA_TOOL_OPTIONS"], f"-Xmx{heap_mb}m"]))
                self.env = ScienceWorldEnv("", envStepLimit=10**9)  # the game keeps its own step limit
            except (OSError, ValueError) as e:  # java missing at exec time, or it printed no port (it could not start)
                raise SimulatorUnavailable(f"{java} could not start ScienceWorld's simulator ({type(e).__name__}: {e}); "
                                           f"it needs Java 11 or newer (Debian/Ubuntu: {JAVA_INSTALL})") from None
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        self.proc = self.env._gateway.java_process
        self.pid = self.proc.pid

    def interface(self):
        """A new world of this JVM (the jar's PythonInterface, what ScienceWorldEnv.server is)."""
        return self.call(self.env._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface)

    def call(self, fn, *args):
        from py4j.protocol import Py4JError, Py4JJavaError

        if self.dead:
            raise SimulatorCrashed(self.died())
        timer = threading.Timer(self.timeout, self._hung)
        timer.daemon = True
        timer.start()
        try:
            return fn(*args)
        except Py4JJavaError as e:  # the simulator threw (out of heap, a bug on some input): the world is not to be trusted
            self.kill()
            raise SimulatorCrashed(f"the simulator failed: {str(e.java_exception)[:300]}") from None
        except (Py4JError, OSError) as e:
            self.kill()
            raise SimulatorCrashed(self.died(f"{type(e).__name__}: {str(e)[:200]}")) from None
        finally:
            timer.cancel()

    hung = False

    def died(self, why: str = "") -> str:
        why = f"no answer within {self.timeout:g} s, so it was killed" if self.hung else why or "it is gone"
        return f"the simulator's JVM (pid {self.pid}) died: {why}"

    def _hung(self) -> None:
        self.hung = True
        self.kill()

    def kill(self) -> None:
        self.dead = True
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        """Shut the gateway and the JVM down and wait for the process, killing it if it lingers."""
        if not self.dead:
            with contextlib.suppress(Exception):
                self.env.close()  # the gateway's shutdown, then a newline that ends the JVM
        self.dead = True
        try:
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        # ScienceWorldEnv.close runs again when the object is collected: on a closed gateway it is quiet.


class JvmWorld:
    """A world in one of the pool's JVMs."""

    def __init__(self, jvm: Jvm):
        self.jvm = jvm
        self.server = jvm.interface()
        jvm.worlds += 1

    @property
    def alive(self) -> bool:
        return not self.jvm.dead

    def load(self, task_type: str, variation: int, simplifications: str, gold: bool) -> None:
        self.jvm.call(self.server.load, task_type, variation, simplifications, gold)

    def step(self, action: str) -> tuple[str, int, bool]:
        observation = self.jvm.call(self.server.step, action)
        # as the package scores a step: the jar's 0-1 score as a whole number of points
        return observation, int(round(100 * self.jvm.call(self.server.getScore))), bool(self.jvm.call(self.server.getCompleted))

    def task_description(self) -> str:
        return self.jvm.call(self.server.getTaskDescription)

    def gold_path(self) -> list[str]:
        return list(self.jvm.call(self.server.getGoldActionSequence))

    def valid_actions(self) -> list[str]:
        return list(self.jvm.call(self.server.getValidActionObjectCombinations))


class JvmBackend:
    """Up to `simulators` JVMs, started when a world is first wanted, `worlds` worlds each."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.jvms: list[Jvm] = []
        self.capacity = settings.simulators * settings.worlds

    def new_world(self) -> JvmWorld:
        for jvm in [j for j in self.jvms if j.dead]:
            jvm.close()  # reaped, so no zombie stays behind
        self.jvms = [j for j in self.jvms if not j.dead]
        room = [j for j in self.jvms if j.worlds < self.settings.worlds]
        if len(self.jvms) < self.settings.simulators and (not room or min(j.worlds for j in room) > 0):
            jvm = Jvm(find_java(), self.settings.heap_mb, self.settings.call_timeout)
            self.jvms.append(jvm)
            room.append(jvm)
        if not room:  # the pool never asks past its capacity
            raise RuntimeError("no JVM has room for another world")
        return JvmWorld(min(room, key=lambda j: j.worlds))

    def warm(self) -> None:
        """Start every JVM now (a bench times steps, not starts)."""
        while len([j for j in self.jvms if not j.dead]) < self.settings.simulators:
            self.jvms.append(Jvm(find_java(), self.settings.heap_mb, self.settings.call_timeout))

    def forget(self, world: World) -> None:
        if isinstance(world, JvmWorld):
            world.jvm.worlds -= 1

    def close(self) -> None:
        for jvm in self.jvms:
            jvm.close()
        self.jvms = []


# ---- the pool: worlds lent to games ----


@dataclass(eq=False)
class Slot:
    """A world and whose game it holds: `owner` (an Episode) and how many of its actions it has
    played (`played`), so a game finds its world as it left it or knows to replay."""

    world: World
    owner: object | None = None
    played: int = -1  # -1: nothing loaded for the owner
    gold: bool = False  # loaded with its gold path
    busy: bool = False
    used: float = field(default_factory=time.monotonic)


class Pool:
    """Worlds of a backend lent to episodes: an episode keeps its world while the pool has room;
    past that, the least recently used idle world is handed over and its old owner replays."""

    def __init__(self, backend: Backend, settings: Settings):
        self.backend, self.settings = backend, settings
        self.slots: list[Slot] = []
        self.gold: dict[tuple[str, int], list[str]] = {}  # gold paths by (task type, variation), once each
        self.cond = threading.Condition()
        self.closed = False

    @contextlib.contextmanager
    def world(self, episode: Episode, gold: bool = False) -> Iterator[World]:
        """A world holding `episode` as it stands (its actions played), busy while in use;
        loaded with its gold path when `gold` or when that task's is not known yet."""
        slot = self._take(episode)
        try:
            want_gold = gold or not self.knows_gold(episode.task_type, episode.variation)
            if slot.played != len(episode.actions) or (want_gold and not slot.gold):
                slot.played = -1
                self._restore(slot.world, episode, want_gold)
                slot.gold = want_gold
                slot.played = len(episode.actions)
            yield slot.world
            slot.played = len(episode.actions)
        except BaseException:
            slot.played = -1  # whatever happened, this world no longer holds the episode as logged
            raise
        finally:
            with self.cond:
                slot.busy, slot.used = False, time.monotonic()
                if not slot.world.alive:
                    self.slots.remove(slot)
                    getattr(self.backend, "forget", lambda w: None)(slot.world)
                self.cond.notify_all()

    def _take(self, episode: Episode) -> Slot:
        with self.cond:
            while True:
                if self.closed:
                    raise RuntimeError("the ScienceWorld simulator pool is closed")
                self.slots = [s for s in self.slots if s.world.alive or s.busy]
                mine = next((s for s in self.slots if s.owner is episode and not s.busy), None)
                if mine is None:  # a world no game holds, before a new one; on the least busy JVM
                    free = [s for s in self.slots if s.owner is None and not s.busy]
                    busy = Counter(getattr(s.world, "jvm", None) for s in self.slots if s.busy)
                    mine = min(free, key=lambda s: busy[getattr(s.world, "jvm", None)]) if free else None
                if mine is None and len(self.slots) < self.backend.capacity:
                    mine = Slot(self.backend.new_world())
                    self.slots.append(mine)
                if mine is None:  # the least recently used idle world: its game will replay
                    idle = [s for s in self.slots if not s.busy]
                    mine = min(idle, key=lambda s: s.used) if idle else None
                if mine is not None:
                    if mine.owner is not episode:
                        mine.owner, mine.played = episode, -1
                    mine.busy = True
                    return mine
                self.cond.wait()  # every world is in use by another thread

    def _restore(self, world: World, episode: Episode, gold: bool) -> None:
        world.load(episode.task_type, episode.variation, self.settings.simplifications, gold)
        if gold:
            self.gold.setdefault((episode.task_type, episode.variation), world.gold_path())  # a known path stands
        episode.description = episode.description or world.task_description()
        first, _, _ = world.step("look around")  # what the package's reset answers: the first observation
        if episode.first is None:
            episode.first = first
        for i, (action, logged) in enumerate(zip(episode.actions, episode.scores)):
            _, score, _ = world.step(action)
            if logged is not None and score != logged:
                raise ReplayDiverged(f"{episode.task_id}: replaying action {i} ({action!r}) scored {score}, logged {logged}")

    def knows_gold(self, task_type: str, variation: int) -> bool:
        """Whether the task's gold path is known: generated before, or stored (tables.py, written by gold.py), which
        then stands, so that the expert plays the same path in every run."""
        from .tables import stored

        key = (task_type, variation)
        if key not in self.gold and (path := stored(task_type, variation, self.settings.simplifications)) is not None:
            self.gold[key] = path
        return key in self.gold

    def release(self, episode: Episode) -> None:
        """The episode is over: its world goes back to the idle ones, to be reloaded by the next."""
        with self.cond:
            for s in self.slots:
                if s.owner is episode and not s.busy:
                    s.owner, s.played, s.used = None, -1, 0.0
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.slots = []
        self.backend.close()


class Episode:
    """The simulator's side of one game: its task, the actions sent and the scores they got.
    Each call borrows a world from the pool; a JVM that dies mid-call is replaced by replaying
    the actions on another, and the call is tried again, up to `restarts` times an episode."""

    def __init__(self, pool: Pool, task_type: str, variation: int, task_id: str):
        self.pool, self.task_type, self.variation, self.task_id = pool, task_type, variation, task_id
        self.actions: list[str] = []  # what the simulator was told, in order
        self.scores: list[int | None] = []  # its score after each (None: not known, so not checked on replay)
        self.description = ""
        self.first: str | None = None
        self.restarts = 0

    def __getstate__(self) -> dict:
        # A game sent to another process (evaluate's workers return theirs) takes its pool's
        # settings, not the pool: locks and JVMs stay where they are, and a copy that plays on
        # borrows from its own process's pool, replaying its actions.
        state = dict(self.__dict__)
        state["pool"] = self.pool.settings
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.pool = pool_for(state["pool"])

    def _retrying(self, what: str, fn, gold: bool = False):
        while True:
            try:
                with self.pool.world(self, gold) as world:
                    return fn(world)
            except SimulatorCrashed as e:
                self.restarts += 1
                if self.restarts > self.pool.settings.restarts:
                    raise SimulatorCrashed(f"ScienceWorld {self.task_id}, {what} (after {len(self.actions)} actions): {e}; "
                                           f"gave up after {self.pool.settings.restarts} restarts in this episode") from None

    def start(self) -> tuple[str, str]:
        """(task description, first observation)."""
        self._retrying("loading the task", lambda w: None)
        return self.description, self.first or ""

    def step(self, action: str) -> tuple[str, int, bool]:
        def play(world: World) -> tuple[str, int, bool]:
            observation, score, completed = world.step(action)
            self.actions.append(action)
            self.scores.append(score)
            return observation, score, completed

        return self._retrying(f"action {len(self.actions)} ({action!r})", play)

    def replayed(self, actions: Sequence[str], scores: Sequence[int | None]) -> None:
        """Take logged actions as played (Game.restore): the world replays them when next used."""
        if self.actions:
            raise RuntimeError("replayed() needs a fresh episode")
        self.actions, self.scores = list(actions), list(scores)

    def gold_path(self) -> list[str]:
        if not self.pool.knows_gold(self.task_type, self.variation):
            self._retrying("generating the gold path", lambda w: None, gold=True)
        return list(self.pool.gold[(self.task_type, self.variation)])

    def valid_actions(self) -> list[str]:
        return self._retrying("listing valid actions", lambda w: w.valid_actions())

    def close(self) -> None:
        self.pool.release(self)


# ---- one pool per settings in a process ----

_POOLS: dict[Settings, Pool] = {}
_LOCK = threading.Lock()


def pool_for(settings: Settings) -> Pool:
    """The process's pool for these settings (started JVMs are shared by every environment
    object built with them: params validation builds several)."""
    with _LOCK:
        if settings not in _POOLS or _POOLS[settings].closed:
            _POOLS[settings] = Pool(JvmBackend(settings), settings)
        return _POOLS[settings]


def close_all() -> None:
    """Close every pool of this process and wait for its JVMs (also run at interpreter exit)."""
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for p in pools:
        p.close()


def running_jvms() -> list[int]:
    """The pids of this process's JVMs still running (for tests and the bench)."""
    with _LOCK:
        jvms = [j for p in _POOLS.values() if isinstance(p.backend, JvmBackend) for j in p.backend.jvms]
    return [j.pid for j in jvms if j.proc.poll() is None]


atexit.register(close_all)
