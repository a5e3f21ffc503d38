"""The controller's rollout side: prompts -> engine requests -> a Batch (single- and multi-turn), the asynchronous
producer and its buffer, routing replay on the controller, and the weight sync into the engines."""
