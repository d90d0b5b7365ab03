//! Users in a cluster (issue 13, item 2): the users live in the replicated metadata, so a node
//! that joins a running cluster logs its users in from there, and its own configuration file
//! (which would seed a fresh single node) changes nothing: the seed runs only while the
//! metadata group has never held a user.
//!
//! Runs in its turn with the other cluster tests (`common::cluster::run`), every step bounded.

mod common;

use common::cluster::{channel, run, Cluster};
use common::*;
use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

#[test]
fn a_joining_node_logs_in_the_clusters_users_and_does_not_seed_its_own() {
    run(async {
        let mut c = Cluster::start(3);
        // Node 4's file names another user only: as a fresh single node it would have no guest.
        let file = tempfile::Builder::new().suffix(".toml").tempfile().expect("config file");
        std::fs::write(file.path(), "[[users]]\nname = \"latecomer\"\npassword = \"pw\"\n").expect("write config");
        let four = c.add_node(&["--join", "--config", file.path().to_str().expect("utf-8 path")]);
        c.wait_members(&[0, 1, 2, four], 4.0).await;

        // guest, seeded by the founding nodes, logs in on node 4 and declares there.
        let n4 = connect_uri(&c.amqp_uri(four)).await;
        let q = uniq("joined");
        t("queue.declare", channel(&n4).await.queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default()))
            .await
            .unwrap();
        // The file's user was not seeded, on node 4 nor anywhere.
        for i in [0, four] {
            let uri = c.amqp_uri(i).replacen("guest:guest", "latecomer:pw", 1);
            assert!(uri.contains("latecomer:pw"), "{uri}");
            let r = t("latecomer login", Connection::connect(&uri, ConnectionProperties::default())).await;
            assert_code(r.map(|_| ()), 403, &format!("the joining node's file user on node {}", i + 1));
        }
        assert!((0..3).any(|i| c.log(i).contains("seeding users")), "a founding node logs its seed");
        assert!(!c.log(four).contains("seeding users"), "node 4 seeded its file:\n{}", c.log(four));
        t("close", n4.close(200, "bye".into())).await.unwrap();
    });
}
