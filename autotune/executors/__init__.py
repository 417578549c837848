"""Where trials run. `base` defines the contract; `ray_executor` runs real trials, `simulated`
prices them with the cost model."""
