"""The embedded servers for `weir up` and the tests: NATS with JetStream, PostgreSQL and SeaweedFS (S3).

Each server is a child process in its own process group, listening on 127.0.0.1 only, its output in
`<data_dir>/logs/<name>.log`, its pid and ports in `<data_dir>/run/<name>.pid`. Children die with their parent, and a
later start on the same data directory cleans up what a killed owner left and reuses its ports when free.
The stack is `shared.devstack.stack.DevStack`; `python -m shared.devstack` runs it (`__main__.py`).
"""
