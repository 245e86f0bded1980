"""The Ray instance that `trainlift train` and `trainlift doctor fabric` start in their own process."""


def test_its_processes_reach_its_own_state_api_on_loopback(ray_local):
    """Ray Train's placement-group cleaner asks the state API, from inside the run, whether the run's controller
    is alive. The lookup must reach this instance's own dashboard (not whatever cluster `ray start` last
    recorded on the machine, which may be dead or a different cluster) and find the actor alive; the dashboard
    listens on loopback only."""
    import psutil

    ray = ray_local

    @ray.remote(num_cpus=0)
    class Probe:
        def lookup_self(self):
            import os

            from ray.util.state import get_actor

            state = get_actor(ray.get_runtime_context().get_actor_id(), timeout=10)
            return os.environ["RAY_API_SERVER_ADDRESS"], state.state if state else None

    probe = Probe.remote()
    try:
        url, state = ray.get(probe.lookup_self.remote(), timeout=60)
    finally:
        ray.kill(probe)
    assert state == "ALIVE"
    assert url.startswith("http://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    assert listening == {"127.0.0.1"}
