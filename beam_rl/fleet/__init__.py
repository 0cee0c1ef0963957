"""The fleet of inference servers while a run goes on: where it is discovered (`discovery`, `dns_fleet`), how
its servers are dealt to dispatch shards (`assignment`). The job's thread that keeps the run directory's
record of it current is beam_rl/job/fleet_keeper.py."""
