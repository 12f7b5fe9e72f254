"""OpenAI-compatible serving layer: routes, protocol shapes and the glm45/glm47 output parsers."""
