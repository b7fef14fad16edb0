"""The CPU engine: SGLang's native HTTP protocol served by a small model on CPU.

Modules, bottom-up:

- :mod:`engine.cpu.model_store` — find/convert the model (``resolve_model``; the default
  SmolLM2-135M-Instruct GGUF is converted once into the user cache);
- :mod:`engine.cpu.model` — hand-written Llama/Mistral/Qwen2 forward over a slot KV pool;
- :mod:`engine.cpu.params`, :mod:`engine.cpu.sampling`, :mod:`engine.cpu.detok`,
  :mod:`engine.cpu.grammar`, :mod:`engine.cpu.lora` — per-request machinery;
- :mod:`engine.cpu.scheduler` — the continuous-batching loop (one thread);
- :mod:`engine.cpu.runner` — ``CpuEngine``: everything loaded together;
- :mod:`engine.cpu.server` — the Quart-Trio/Hypercorn HTTP server, ``main(argv)``.

Nothing here imports the gateway package ``sieproxy``.
"""

__all__: list[str] = []
