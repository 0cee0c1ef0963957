"""The cyclic garbage collector in a process that dispatches: what it holds for good is frozen out of the
collector's passes, and the passes themselves are made rarer, since a shard's in-flight rollouts are most of
its heap (bench/README.md, "One shard against a simulated fleet").

- A shard keeps thousands of rollouts in flight, each a few hundred tracked objects (its connection, stream
  reader, buffers, tasks, tokens) that live as long as the rollout; every streamed event allocates more that
  die at once. With CPython's default thresholds (700, 10, 10) the young collections run hundreds of times a
  second and keep promoting the in-flight objects, which the full passes then walk (1.6 s each with 12,000 in
  flight).
- Objects die by reference counting; the collector only finds cycles, and a cycle lives a little longer with
  higher thresholds. Nothing in the dispatch path depends on when a cycle is collected.
"""

from __future__ import annotations

import gc

# Young generation: a collection every 50,000 allocations net of deallocations, not every 700; the middle and
# old ones then every 20 and 100 of the one below (CPython still runs a full pass only once a quarter of the
# old generation is new since the last one).
THRESHOLDS = (50_000, 20, 100)


def settle_heap() -> None:
    """Once the worker's long-lived state is built (modules, tokenizer, environments, the runner's harness:
    ~480k objects, whose full pass held the GIL ~0.24 s every ~4 s of a busy run): collect, so that no garbage
    is kept, freeze what is left out of every later pass, and make the passes rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
