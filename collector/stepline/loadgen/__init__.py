"""Load against an OpenAI-compatible engine: the engine as a client sees it (`client`), the interference matrix
(`matrix`),
sweeps over freshly launched engines (`sweep`), and replays of a recorded window (`replay`, `replay_plan`)."""
