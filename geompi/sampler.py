"""``geompi.DistributedSampler``: a disjoint shard of a dataset for each worker of the job."""

from __future__ import annotations

import torch.utils.data


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler over geompi's workers (servers hold no data).

    Every worker gets the same number of samples per epoch (padded by repeating a few, or
    trimmed with ``drop_last=True``), so every worker takes the same number of steps, which the
    synchronous algorithms need. Call ``set_epoch(epoch)`` each epoch to reshuffle.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        from geompi import session

        s = session.worker_session()
        super().__init__(
            dataset,
            num_replicas=s.topo.num_workers,
            rank=s.topo.worker_index(s.rank),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
