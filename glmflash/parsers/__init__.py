"""Output parsers shared by `Engine.chat` and the server: glm45 reasoning, glm47 tool calls."""
