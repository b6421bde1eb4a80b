"""Pipelined generation: ``pipe.generate()`` with each stage holding its own layers'
key/value cache (and, for an encoder-decoder, its cross-attention layers' keys and values of
the encoder's output), lanes of sequences in flight through a ring of stages.

- :mod:`~fxpipe.generation.cache`: the static cache per stage, and the cache objects
  transformers' code talks to;
- :mod:`~fxpipe.generation.forms`: what each variant of a step traces (decoder-only, an
  encoder-decoder's encoder and decoder);
- :mod:`~fxpipe.generation.step`: one generation step traced with its cache and split along
  the pipeline's borders (prefill and decode variants, and encode for an encoder-decoder);
- :mod:`~fxpipe.generation.calls`: ``generate``'s calls to the model as a step's inputs;
- :mod:`~fxpipe.generation.request`: a ``generate`` call checked and resolved (what is
  refused, the cache's length, the rows' groups and lanes);
- :mod:`~fxpipe.generation.ring`: the stage workers lanes' steps pass through;
- :mod:`~fxpipe.generation.driver`: ``generate``'s own loop per lane over the ring;
- :mod:`~fxpipe.generation.ranks`: the same, one process per stage (a distributed
  pipeline's ``generate``), its messages in :mod:`~fxpipe.generation.wire`.
"""

from fxpipe.generation.driver import GenerationRun, Generator

__all__ = ["Generator", "GenerationRun"]
