"""The producer side: the stages one batch passes through, and what they share.

:mod:`~slafload.pipeline.chain` builds the chain, in this order::

    partition -> read (reader) -> chunk -> tokenize (the token stage: ranking, batcher, layout)
              -> batcher (to torch) -> prefetcher

:mod:`~slafload.pipeline.epochs` plans each epoch and keeps positions for resume;
:mod:`~slafload.pipeline.stage` is the protocol every stage implements.
"""
