"""Test helpers: `*_kit` (functions, fixtures), `*_worker` (a process a test starts),
`*_tasks` (tasks named in test configs), `*_servers` (local servers)."""
