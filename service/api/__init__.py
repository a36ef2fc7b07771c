"""The HTTP edge: the app and its middleware (app, middleware), one router per concern (embed, openai, health),
what they share (dependencies, cancellation, embedding), request and response bodies (schemas, answers), errors
mapped once (errors), and the HTTP protocol and server (protocol, server)."""
