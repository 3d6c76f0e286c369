import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from relax.core.hookspecs import hookimpl
from relax.core.weight_sync import Receiver, Transport, WeightSyncError
from relax.core.weight_sync.base import bucket_nbytes


@dataclass(frozen=True)
class ChecksumParams:  # weight_sync.params
    algorithm: Literal["crc32", "adler32"] = "crc32"


def checksums(bucket, algorithm):
    digest = getattr(zlib, algorithm)
    return [digest(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()) for _, t in bucket]


class ChecksumReceiver(Receiver):  # runs in the engine's process
    def update_checked(self, bucket, sums, version):
        if checksums(bucket, self.transport.params.algorithm) != sums:
            raise WeightSyncError(f"weights for version {version} arrived corrupted")
        self.engine.update_weights(bucket, version)


class ChecksumSync(Transport):  # its send() runs in the trainer's process
    name, config, receiver_cls = "checksummed", ChecksumParams, ChecksumReceiver

    def send(self, trainer, peers, version):
        for i, bucket in enumerate(trainer.export_weights(self.bucket_bytes)):
            sums = checksums(bucket, self.params.algorithm)
            peers.call("update_checked", bucket, sums, version, what=f"bucket {i} of version {version}")
            yield bucket_nbytes(bucket)


@hookimpl
def relax_register_weight_syncs(register):
    register("checksummed", ChecksumSync, config=ChecksumParams)
