"""`batchgen simulate`: the real scheduler driven by a cost model (see driver.py)."""

from batchgen.simulate.config import LengthDist, SimulationConfig, load_workload
from batchgen.simulate.driver import SimulationResult, plot_timeline, run_simulation

__all__ = ["LengthDist", "SimulationConfig", "SimulationResult", "load_workload",
           "plot_timeline", "run_simulation"]
