"""Create a container on the Azure account of ``AZURE_STORAGE_CONNECTION_STRING`` (Azurite's, for
the demo and CI), waiting until the emulator answers.

Usage: ``python examples/azurite_container.py NAME``; an existing container is fine.
"""

from __future__ import annotations

import os
import sys
import time

from azure.core.exceptions import ResourceExistsError, ServiceRequestError
from azure.storage.blob import BlobServiceClient

WAIT_S = 60.0


def main(name: str) -> int:
    """Create container `name`; 0 once it exists, 1 when the service never answered."""
    client = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            client.create_container(name)
            return 0
        except ResourceExistsError:
            return 0
        except ServiceRequestError:  # not listening yet
            if time.monotonic() > deadline:
                print(f"no Azure Blob service answered within {WAIT_S:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
