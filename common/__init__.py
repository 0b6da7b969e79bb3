"""The shared kernel: what the controller and the node agent both run, below every layer of
either (see docs/architecture.md, 'Layers'): the contract (:mod:`common.contract`), the
enrollment token's and transfer ticket's forms, model sources, the GGUF header reader, the model
file server and the event loop."""
