"""The job layer: starting, following and stopping a run. It starts the inference servers (`servers`),
checks them (`preflight`), assembles the Beam graph (`graph`), submits and follows the rollout job
(`rollouts`), keeps the fleet's record (`fleet_keeper`), and shows the live table (`live`) until
`run.run_job` is done. The one part of beam_rl that imports Beam; nothing below it imports it."""
