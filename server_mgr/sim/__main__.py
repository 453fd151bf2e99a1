"""``python -m server_mgr.sim``: the same command as ``tokenmill server sim``."""

from server_mgr.sim.cli import sim

if __name__ == "__main__":
    sim(prog_name="python -m server_mgr.sim")
