"""Layer definitions every backend shares, framework-free: the contract, recipes, block splits, chunk walk.

::

    layer_contract   the per-layer interface the executor drives (forward, backward, weights)
    layer_recipes    the order of operations of composite layers
    split_blocks     a transformer block as one layer or as two halves
    chunk_layout     how a run of spec layers is walked into a chunk
"""
