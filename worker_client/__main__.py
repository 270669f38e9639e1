"""`python -m worker_client` runs one training worker, like the `ps-worker` command."""

from worker_client.cli import main

raise SystemExit(main())
