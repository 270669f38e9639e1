"""`python -m ps_server` runs one shard, like the `ps-server` command."""

from ps_server.cli import main

raise SystemExit(main())
