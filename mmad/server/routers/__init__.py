"""One router per resource; ``ALL`` is the order the app mounts them (fixed paths before ``{model}``)."""

from mmad.server.routers import datasets, devices, health, jobs, metrics, models, repository, shm, training, workers

ALL = (health.router, metrics.router, devices.router, repository.router, training.router, datasets.router,
       jobs.router, shm.router, workers.router, models.router)
