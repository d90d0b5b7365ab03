//! Unit tests of `access.rs`: password hashes, logins, the permission model.

use super::*;
use crate::meta::access::{Access, Permission, UserDef};

fn topology(perm: Option<(&str, &str, &str)>) -> Topology {
    let mut t = Topology::default();
    t.vhosts.insert("/".into());
    let mut access = Access::default();
    access.users.insert("u".into(), UserDef { name: "u".into(), password_hash: hash_password("pw"), tags: vec!["monitoring".into()] });
    if let Some((c, w, r)) = perm {
        let p = Permission { user: "u".into(), vhost: "/".into(), configure: c.into(), write: w.into(), read: r.into() };
        access.permissions.insert(("u".into(), "/".into()), p);
    }
    t.access = access;
    t
}

fn config(loopback_only: bool) -> Config {
    let file = format!("[[users]]\nname = \"u\"\npassword = \"pw\"\nloopback_only = {loopback_only}\n");
    crate::config::tests::load(&[], &file).unwrap()
}

#[test]
fn external_login_needs_the_user_but_no_password() {
    let t = topology(None);
    assert_eq!(authenticate_external(&t, &config(false), "u", false).unwrap().name, "u");
    assert!(matches!(authenticate_external(&t, &config(false), "who", true), Err(AccessError::LoginRefused { .. })));
    assert!(matches!(authenticate_external(&t, &config(true), "u", false), Err(AccessError::LoopbackOnly { .. })));
    assert!(authenticate_external(&t, &config(true), "u", true).is_ok());
}

#[test]
fn hashes_are_rabbitmqs_salted_sha256() {
    // RabbitMQ: base64(<<Salt:4/binary, (crypto:hash(sha256, <<Salt, Password>>))/binary>>).
    let h = hash_password_with_salt([0x90, 0x8d, 0xc6, 0x0a], "test12");
    assert_eq!(h, "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR");
    assert!(check_password(&h, "test12"));
    assert!(!check_password(&h, "test13"));
    assert!(!check_password("", ""), "no password: no login");
    assert!(!check_password("not base64!", "x"));
    let (a, b) = (hash_password("same"), hash_password("same"));
    assert!(check_password(&a, "same") && check_password(&b, "same"));
}

#[test]
fn logins_check_the_password_and_loopback() {
    let t = topology(Some((".*", ".*", ".*")));
    let u = authenticate(&t, &config(false), "u", "pw", false).unwrap();
    assert_eq!((u.name.as_str(), u.tags.as_slice()), ("u", &["monitoring".to_string()][..]));
    assert!(matches!(authenticate(&t, &config(false), "u", "bad", true), Err(AccessError::LoginRefused { .. })));
    assert!(matches!(authenticate(&t, &config(false), "who", "pw", true), Err(AccessError::LoginRefused { .. })));
    assert!(matches!(authenticate(&t, &config(true), "u", "pw", false), Err(AccessError::LoopbackOnly { .. })));
    assert!(authenticate(&t, &config(true), "u", "pw", true).is_ok());
    // guest is loopback-only unless the file says otherwise of it.
    assert!(loopback_only(&config(false), "guest") && !loopback_only(&config(false), "u"));
    let open = crate::config::tests::load(&[], "[[users]]\nname = \"guest\"\npassword = \"guest\"\n").unwrap();
    assert!(!loopback_only(&open, "guest"));
}

#[test]
fn vhost_access_needs_a_permission() {
    assert!(check_vhost_access(&topology(Some(("", "", ""))), "u", "/").is_ok());
    let e = check_vhost_access(&topology(None), "u", "/").unwrap_err();
    assert_eq!(e.to_string(), "access to vhost '/' refused for user 'u'");
    assert!(matches!(check_vhost_access(&topology(None), "u", "v"), Err(AccessError::NotFound(_))));
}

#[test]
fn checks_follow_rabbitmqs_model() {
    let t = topology(Some(("^app\\.", "^(app\\..*|amq\\.default)$", "")));
    let mut g = Grant::new("u", "/");
    assert!(g.check(1, &t, Perm::Configure, Resource::Queue, "app.q").is_ok());
    assert!(g.check(1, &t, Perm::Configure, Resource::Queue, "xapp.q").is_err(), "the user's ^ anchors");
    assert!(g.check(1, &t, Perm::Write, Resource::Exchange, "").is_ok(), "the default exchange is amq.default");
    let e = g.check(1, &t, Perm::Read, Resource::Queue, "app.q").unwrap_err();
    assert_eq!(e.to_string(), "access to queue 'app.q' in vhost '/' refused for user 'u'", "empty matches nothing");
    // A change of the permission is seen at the next version; the same version is not looked
    // at again.
    let open = topology(Some((".*", ".*", ".*")));
    assert!(g.check(1, &open, Perm::Read, Resource::Queue, "app.q").is_err());
    assert!(g.check(2, &open, Perm::Read, Resource::Queue, "anything").is_ok());
    let e = g.check(3, &topology(None), Perm::Write, Resource::Exchange, "x").unwrap_err();
    assert_eq!(e.to_string(), "access to exchange 'x' in vhost '/' refused for user 'u'");
}

#[test]
fn the_seed_gives_every_user_everything_unless_told() {
    let c = config(true);
    let cmds = seed_commands(&c).unwrap();
    assert!(matches!(&cmds[0], Command::DeclareVhost { name } if name == "/"));
    let Command::PutUser(u) = &cmds[1] else { panic!("{cmds:?}") };
    assert!(check_password(&u.password_hash, "pw"));
    assert!(matches!(&cmds[2], Command::SetPermission(p) if p.configure == ".*" && p.read == ".*"));
    let told = crate::config::tests::load(&[], "[[users]]\nname = \"u\"\npassword_hash = \"kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR\"\n[[permissions]]\nuser = \"u\"\nconfigure = \"a\"\nwrite = \"b\"\nread = \"c\"\n").unwrap();
    let cmds = seed_commands(&told).unwrap();
    assert!(matches!(&cmds[1], Command::PutUser(u) if check_password(&u.password_hash, "test12")));
    assert!(matches!(&cmds[2], Command::SetPermission(p) if p.configure == "a" && p.write == "b" && p.read == "c"));
    assert_eq!(cmds.len(), 3);
    let bad = |file: &str| match seed_commands(&crate::config::tests::load(&[], file).unwrap()) {
        Err(AccessError::Invalid(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(bad("[[users]]\nname = \"u\"\npassword_hash = \"c2hvcnQ=\"\n").contains("user 'u'"));
    let m = bad("[[policies]]\nname = \"p\"\npattern = \".*\"\ndefinition = { max-lenght = 2 }\n");
    assert!(m.contains("policy 'p'") && m.contains("max-lenght"), "{m}");
}

/// The run-time API over a one-node metadata group, as the management API will call it; the
/// state survives a restart of the group.
#[test]
fn the_run_time_api_changes_the_metadata_durably() {
    use crate::broker::policy::{self, PolicySpec};
    use crate::meta::access::ApplyTo;
    use futures_lite::future::block_on;
    let dir = tempfile::tempdir().unwrap();
    let meta = MetaHandle::start(dir.path(), 1).unwrap();
    let cfg = config(false);
    block_on(async {
        assert!(add_vhost(&meta, "/").await.unwrap());
        assert!(!add_vhost(&meta, "/").await.unwrap(), "existed");
        add_user(&meta, "u", Password::Clear("pw".into()), vec!["management".into()]).await.unwrap();
        assert!(matches!(add_user(&meta, "u", Password::None, vec![]).await, Err(AccessError::AlreadyExists(_))));
        assert!(matches!(put_user(&meta, "h", Password::Hash("short".into()), vec![]).await, Err(AccessError::Invalid(_))));
        let h = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR";
        assert!(put_user(&meta, "h", Password::Hash(h.into()), vec![]).await.unwrap(), "created");
        assert!(!put_user(&meta, "h", Password::Hash(h.into()), vec!["monitoring".into()]).await.unwrap(), "replaced");
        assert!(authenticate(&meta.topology(), &cfg, "h", "test12", true).is_ok(), "an imported hash logs in");
        change_password(&meta, "u", "new").await.unwrap();
        assert!(authenticate(&meta.topology(), &cfg, "u", "pw", true).is_err());
        assert!(authenticate(&meta.topology(), &cfg, "u", "new", true).is_ok());
        set_user_tags(&meta, "u", vec!["administrator".into()]).await.unwrap();
        assert_eq!(user(&meta, "u").unwrap().tags, ["administrator"]);
        assert!(matches!(set_permissions(&meta, "u", "/", "(", ".*", ".*").await, Err(AccessError::Invalid(_))));
        assert!(matches!(set_permissions(&meta, "u", "nope", ".*", ".*", ".*").await, Err(AccessError::NotFound(_))));
        set_permissions(&meta, "u", "/", "^u\\.", ".*", "").await.unwrap();
        assert_eq!(permissions(&meta).len(), 1);
        let def = serde_json::json!({"max-length": 5});
        let spec = PolicySpec { vhost: "/", name: "p", pattern: "^q", apply_to: ApplyTo::Queues, priority: 1, definition: &def };
        policy::set_policy(&meta, &spec).await.unwrap();
        policy::set_operator_policy(&meta, &PolicySpec { name: "o", ..spec.clone() }).await.unwrap();
        assert!(matches!(policy::set_policy(&meta, &PolicySpec { vhost: "nope", ..spec.clone() }).await, Err(AccessError::NotFound(_))));
        assert_eq!((policy::policies(&meta).len(), policy::operator_policies(&meta).len()), (1, 1));
        clear_password(&meta, "h").await.unwrap();
        assert!(authenticate(&meta.topology(), &cfg, "h", "test12", true).is_err(), "no password, no login");
        delete_user(&meta, "h").await.unwrap();
        assert!(matches!(delete_user(&meta, "h").await, Err(AccessError::NotFound(_))));
        assert!(add_vhost(&meta, "v").await.unwrap());
        set_permissions(&meta, "u", "v", ".*", ".*", ".*").await.unwrap();
        delete_vhost(&meta, "v").await.unwrap();
        assert_eq!(vhosts(&meta), ["/"]);
        assert_eq!(permissions(&meta).len(), 1, "the deleted vhost's permission went with it");
        policy::clear_operator_policy(&meta, "/", "o").await.unwrap();
        assert!(matches!(policy::clear_policy(&meta, "/", "o").await, Err(AccessError::NotFound(_))));
    });
    meta.shutdown();
    drop(meta);
    let meta = MetaHandle::start(dir.path(), 1).unwrap();
    let t = meta.topology();
    assert_eq!(t.access.users.keys().collect::<Vec<_>>(), ["u"]);
    assert!(authenticate(&t, &cfg, "u", "new", true).is_ok());
    assert_eq!(t.access.permission("u", "/").map(|p| p.configure.as_str()), Some("^u\\."));
    assert_eq!(policy::policies(&meta).len(), 1);
    assert!(policy::operator_policies(&meta).is_empty());
    meta.shutdown();
}
