"""Pictures of a simulated iteration: a Gantt PNG and a Chrome/Perfetto trace."""
