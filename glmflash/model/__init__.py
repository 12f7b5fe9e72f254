"""The GLM-5.3-Flash network (reads like spec/model.md)."""
