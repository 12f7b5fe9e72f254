"""The serving engine: sequences, scheduling, the model runner, sampling."""
