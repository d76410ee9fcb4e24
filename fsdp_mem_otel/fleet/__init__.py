"""What runs on the fleet side, without torch: the metric catalog, the sidecar (``serve``) and its
HTTP server, rank files, and what ships for Prometheus, Grafana and Kubernetes (rules,
dashboards, manifests)."""
