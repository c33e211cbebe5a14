"""The engine's public, torch-free surface: the only part of ``gpu_engine`` the Django side imports.

Importing this package imports nothing else; each module is a small, named door:

=================  ===========================================================================
``protocol``       every job, spec, result and event in one import (the modules below)
``fields``         value ranges declared once (msgspec constraints pydantic reuses), shared values
``codec``          JSON and JSON-native values of messages, refusals as ``InvalidParameter``
``sampling``       sampling parameters, structured output
``steering``       steering specs, feature controls, the canonical steering hash
``capabilities``   what a loaded backend can do (``Capabilities``, read as attributes)
``monitoring``     monitor specs and activation records
``capture``        hidden-state and attention capture specs and results
``jobs``           generation, embedding, scoring and hidden-state jobs; load and attach options
``results``        command results, generation events, engine status
``commands``       the command table both the web's client and the engine implement
``errors``         ``EngineError`` and its codes, ``error_from_dict``
``transport``      the Redis Streams envelope and key names the web's Redis client speaks
``artifacts``      stored capture files: names, ids, writing, reading (numpy; torch on request)
``archives``       bounded ``.npz`` and safetensors reading (``ArchiveRefused``)
``analysis``       the analyzer registry and what an analysis needs captured
``sae``            SAE metadata and compatibility, steering-vector files (no torch)
``host``           model-directory inspection, host memory, the names of the backends
``model_dir``      a model directory's geometry from ``config.json`` and safetensors headers
``architectures``  the decoder architectures known, and where each keeps its block list
``memory``         the host's available memory, handing freed heap back to the system
=================  ===========================================================================

The protocol, the command table, the errors, the streams' transport and the torch-free readers
(``artifacts``, ``archives``, ``model_dir``, ``architectures``, ``memory``) live here, and the
engine's own modules import them from here; ``analysis``, ``sae`` and ``host`` re-export, for
the web, what the engine package owning it holds. Two contracts keep the door
(pyproject.toml): Django packages import only ``gpu_engine.api`` from the engine (the
embedded runtime builder and ``run_engine`` are the named exceptions), and nothing here
imports torch, transformers, vLLM or llama.cpp (tests/foundation/test_layers.py also
imports every module of this package in a fresh interpreter and checks ``sys.modules``).
"""
