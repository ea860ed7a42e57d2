"""The engine: what serves and trains models, behind one typed async interface that every front
end (HTTP in :mod:`mmad.server`, gRPC in :mod:`mmad.grpc`) talks to.

- :mod:`mmad.engine.api`: the request/response dataclasses and the :class:`EngineClient`
  protocol (:class:`InferenceClient`, :class:`ModelStoreClient`, :class:`TrainingClient`);
- :mod:`mmad.engine.inprocess`: :class:`InProcessEngine`, the engine in the front end's own
  process;
- :mod:`mmad.engine.auth`: the API-key check each front end applies to its transport's
  credentials (the engine decides what a caller so established may do).

Under them the components of one daemon process (:class:`~mmad.engine.runtime.Runtime`): the
registry of models and its batchers, the infer pipeline (:mod:`mmad.engine.inference`), training
(:mod:`mmad.engine.training`, :mod:`mmad.engine.jobs`), datasets, the store, the shared-memory
regions and the metrics. Settings come in from :mod:`mmad.settings`; devices are the backends'
(:mod:`mmad.backends`), reached through their contract. Nothing here imports a front end.

The engine raises mmad's error tree (:mod:`mmad.errors`); front ends map it to their status codes.
"""

from mmad.engine.api import (
    Caller, EngineClient, InferenceClient, InferInput, InferOutput, InferRequest, InferResponse,
    ModelStoreClient, RequestedOutput, ShmRef, TrainingClient,
)

__all__ = ["Caller", "EngineClient", "InferenceClient", "InferInput", "InferOutput", "InferRequest", "InferResponse",
           "ModelStoreClient", "RequestedOutput", "ShmRef", "TrainingClient"]
