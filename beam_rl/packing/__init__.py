"""Packing, the stage that turns scored groups into numbered train batches (transforms/pack.py):
`batches.py`'s `BatchBuilder` holds the observation window and cuts batches, `packer.py` decides when a
batch is full and packs its samples into micro-batches per rank, `goodput.py` counts every generated
token by what became of it."""
