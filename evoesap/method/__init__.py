"""The allocation search: budgets and feasible allocations (`allocation`), the level-switch search (`search`), racing
over sample subsets (`racing`) and candidates scored on several processes (`distributed`). Pure Python + numpy,
except `distributed`'s process launch."""
