"""The dispatcher (Beam-free): permits, server pool, group scheduling and exactly-once rollout emission."""

from beam_rl.dispatch.dispatcher import ENV_MODES, Dispatcher, EnvMode
from beam_rl.dispatch.ledger import DispatchCounters, rollout_seed
from beam_rl.dispatch.permits import Permits
from beam_rl.dispatch.server_pool import Server, ServerPool
from beam_rl.dispatch.thread_host import DispatcherThread

__all__ = [
    "ENV_MODES",
    "DispatchCounters",
    "Dispatcher",
    "DispatcherThread",
    "EnvMode",
    "Permits",
    "Server",
    "ServerPool",
    "rollout_seed",
]
