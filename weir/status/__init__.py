"""`weir status`: one view of a running stack, read from where each figure lives (services' /readyz, /version and
/metrics, JetStream's stream and consumer info, the database), then shaped as a JSON document and an exit code
(verdict.py) or drawn for a terminal (render.py). Reading is per area (services, limits, bus, database; gather.py
reads them all); the shaping and drawing are pure and unit-tested."""
