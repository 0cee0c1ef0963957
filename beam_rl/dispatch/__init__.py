"""The dispatcher (Beam-free): permits, server pool, group scheduling and exactly-once rollout emission."""

from beam_rl.dispatch.dispatcher import ENV_MODES, STALE_RULES, Dispatcher, EnvMode, StaleRule
from beam_rl.dispatch.ledger import DispatchCounters, rollout_seed
from beam_rl.dispatch.permits import Permits
from beam_rl.dispatch.server_pool import PoolClient, Restore, Server, ServerPool
from beam_rl.dispatch.thread_host import DispatcherThread

__all__ = [
    "ENV_MODES",
    "STALE_RULES",
    "DispatchCounters",
    "Dispatcher",
    "DispatcherThread",
    "EnvMode",
    "Permits",
    "PoolClient",
    "Restore",
    "Server",
    "ServerPool",
    "StaleRule",
    "rollout_seed",
]
