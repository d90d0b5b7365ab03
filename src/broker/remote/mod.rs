//! Serving a queue from any node: the client's node forwards queue operations to the queue's
//! node and hands what comes back to its connections (DESIGN.md, "Cluster": "any node serves
//! any queue").

pub mod wire;
