"""moto's ECS with an agent that runs its tasks as real containers, for tests/tests/ecs_job.rs.

moto keeps ECS's state (task definitions, tasks, secrets, log streams) but runs nothing. This process
starts moto in-process, seeded as backends/tests/ecs/moto_fixture.py seeds it (what infra/ecs would
create), and does what the ECS container agent would do for every task moto starts:

- the task's ENI gets an address of a Docker network made for the run (a /24 of the VPC's 172.31.0.0/16),
- the init container `secrets` runs first, with `--network none`, the task definition's environment and
  its `secrets` resolved from Secrets Manager (handed to `docker run` through its environment, never as
  an argument), writing into a volume of the task,
- the task's security groups (its ENI's, from moto's EC2: infra/ecs's ingress rules, which
  moto_fixture copies from infra/ecs/main.tf) guard the ENI's address before anything runs there
  (tests/firewall.py): only what the groups open reaches the task,
- then the `worker` container, on the Docker network at the ENI's address, the volume mounted read-only
  (labelled `physalia.ecs-agent.container=worker`, as a coordinator's is `=coordinator`),
- its output goes to CloudWatch Logs (`<awslogs-stream-prefix>/worker/<task id>`) every second and at
  its end,
- when the worker container exits, the task is stopped in moto with the container's exit code, as ECS
  records it ("Essential container in task exited"),
- when the task is stopped through the API (StopTask), its containers are removed.

Cluster mode's coordinator tasks (task definition family `physalia-<job>-coordinator`, one `coordinator`
container) run the same way, as the coordinator image at the task's ENI address, with what the ECS agent
gives a task with a task role: `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`, answered at 169.254.170.2 (a
shared internal Docker network, `physalia-ecs-credentials`, whose gateway is this machine) by a small
HTTP server handing out moto's test credentials, and the region. The container also gets moto's
endpoint (`AWS_ENDPOINT_URL`, plain HTTP): moto listens on the Docker network's gateway address, which
this machine and the containers reach, and nothing else.

Also makes the S3 bucket `physalia-jobs` for job stores. Everything is in moto's us-east-1 unless
`--region R` names another region (the bucket then has R as its location constraint).

Prints one JSON line (moto_fixture's, plus `network`, the Docker network, and `bucket`), then serves
until its standard input closes, and removes every container, volume and network it made.

  python3 ecs_agent.py [--tasks-stay-running is implied]
"""

import argparse
import datetime
import http.server
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "backends", "tests", "ecs"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import boto3  # noqa: E402
import firewall  # noqa: E402
import moto.ecs.models as ecs_models  # noqa: E402
import moto.ecs.responses as ecs_responses  # noqa: E402
import moto_fixture  # noqa: E402

LABEL = f"physalia.ecs-agent={os.getpid()}"

# What the ECS agent registers for a g5.xlarge (4 vCPU, 16 GiB, one A10G): 1024 CPU units per vCPU, the
# memory Linux reports (MemTotal, less ECS_RESERVED_MEMORY's default 0), not the 16,384 MiB EC2
# advertises (the ECS developer guide's "Container instance memory management": an m4.large's 8 GiB
# registers as 7,985 MiB), and its GPU. AWS publishes no per-type figure; 15,785 MiB is in the range
# g5.xlarge instances on the ECS-optimized GPU AMI register.
G5_XLARGE = {"CPU": 4096, "MEMORY": 15785, "GPU": 1}


def _resource(name: str, value: int) -> dict:
    return {"doubleValue": 0.0, "integerValue": value, "longValue": 0, "name": name,
            "type": "INTEGER"}


def as_g5_xlarge(ci) -> None:
    """Gives a container instance a g5.xlarge's registered resources (moto registers 4096 / 7482)."""
    for res in (ci.registered_resources, ci.remaining_resources):
        for r in res:
            if r["name"] in ("CPU", "MEMORY"):
                r["integerValue"] = G5_XLARGE[r["name"]]
    ci.registered_resources.append(
        {"doubleValue": 0.0, "integerValue": 0, "longValue": 0, "name": "GPU",
         "type": "STRINGSET", "stringSetValue": ["GPU-0d1f2a3b-0000-0000-0000-000000000000"]})
    ci.physalia_gpus = G5_XLARGE["GPU"]


def task_requirements(td) -> dict:
    """What ECS places a task by: the task-level CPU and memory where the task definition has them
    (moto sums the containers'), its containers' GPUs, its placement constraints."""
    req = _calculate(td)
    if getattr(td, "cpu", None):
        req["CPU"] = int(td.cpu)
    if getattr(td, "memory", None):
        req["MEMORY"] = int(td.memory)
    req["GPU"] = sum(
        int(r.get("value", 0))
        for c in td.container_definitions
        for r in (c.get("resourceRequirements") or [])
        if r.get("type") == "GPU"
    )
    req["CONSTRAINTS"] = [c for c in (td.placement_constraints or []) if c.get("type") == "memberOf"]
    return req


def matches(expression: str, attributes: dict) -> bool:
    """ECS's cluster query language, as far as physalia's constraints use it:
    `attribute:NAME == V`, `!= V`, `in [A, B]`, `not_in [...]`, `=~ REGEX`, `!~ REGEX`."""
    import re
    m = re.fullmatch(r"\s*attribute:([\w.\-]+)\s*(==|!=|=~|!~|in|not_in)\s*(.+?)\s*", expression)
    if not m:
        raise ValueError(f"unsupported placement constraint expression {expression!r}")
    name, op, value = m.groups()
    have = attributes.get(name)
    if op in ("in", "not_in"):
        if not (value.startswith("[") and value.endswith("]")):
            raise ValueError(f"`{op}` takes a list: {expression!r}")
        values = [v.strip() for v in value[1:-1].split(",")]
        return (have in values) == (op == "in")
    if op in ("==", "!="):
        return (have == value) == (op == "==")
    found = have is not None and re.fullmatch(value, have) is not None
    return found == (op == "=~")


def why_not(ci, req: dict) -> str | None:
    """Why the task cannot be placed on `ci` (ECS's failure reasons), or None."""
    attributes = {a: v for a, v in (ci.attributes or {}).items()}
    for c in req.get("CONSTRAINTS", []):
        if not matches(c.get("expression", ""), attributes):
            return "MemberOf placement constraint unsatisfied."
    left = {r["name"]: r.get("integerValue", 0) for r in ci.remaining_resources}
    if req.get("CPU", 0) > left.get("CPU", 0):
        return "RESOURCE:CPU"
    if req.get("MEMORY", 0) > left.get("MEMORY", 0):
        return "RESOURCE:MEMORY"
    if req.get("GPU", 0) > getattr(ci, "physalia_gpus", 0):
        return "RESOURCE:GPU"
    return None


_calculate = ecs_models.EC2ContainerServiceBackend._calculate_task_resource_requirements
_update = ecs_models.EC2ContainerServiceBackend.update_container_instance_resources
_run_task = ecs_models.EC2ContainerServiceBackend.run_task
_run_task_response_moto = ecs_responses.EC2ContainerServiceResponse.run_task
LAST_FAILURES: list[dict] = []


def _can_be_placed(ci, req) -> bool:
    return why_not(ci, req) is None


def _update_resources(self, ci, req, removing=False):
    _update(self, ci, req, removing)
    ci.physalia_gpus = getattr(ci, "physalia_gpus", 0) + (1 if removing else -1) * req.get("GPU", 0)


def _strict_run_task(self, cluster_str, task_definition_str, count, overrides, started_by, tags,
                     launch_type, networking_configuration, *rest, **kw):
    """moto's RunTask, placing as ECS does; a task that fits no instance is a failure with ECS's
    reason (moto would raise or return nothing and no reason)."""
    LAST_FAILURES.clear()
    if launch_type == "FARGATE":
        return _run_task(self, cluster_str, task_definition_str, count, overrides, started_by, tags,
                         launch_type, networking_configuration, *rest, **kw)
    cluster = self._get_cluster(cluster_str)
    instances = [ci for ci in self.container_instances.get(cluster.name, {}).values()
                 if ci.status == "ACTIVE"]
    arn = cluster.arn
    if not instances:
        LAST_FAILURES.append({"arn": arn, "reason": "No Container Instances were found in your cluster."})
        return []
    req = task_requirements(self.describe_task_definition(task_definition_str))
    reasons = [why_not(ci, req) for ci in instances]
    if all(reasons):
        for ci, reason in zip(instances, reasons):
            LAST_FAILURES.append({"arn": ci.container_instance_arn, "reason": reason})
        return []
    return _run_task(self, cluster_str, task_definition_str, count, overrides, started_by, tags,
                     launch_type, networking_configuration, *rest, **kw)


def _run_task_response(self):
    result = _run_task_response_moto(self)
    if LAST_FAILURES:
        result.result["failures"] = list(LAST_FAILURES)
    return result


ecs_models.EC2ContainerServiceBackend._calculate_task_resource_requirements = staticmethod(
    task_requirements)
ecs_models.EC2ContainerServiceBackend._can_be_placed = staticmethod(_can_be_placed)
ecs_models.EC2ContainerServiceBackend.update_container_instance_resources = _update_resources
ecs_models.EC2ContainerServiceBackend.run_task = _strict_run_task
ecs_responses.EC2ContainerServiceResponse.run_task = _run_task_response
ACCOUNT = "123456789012"


def docker(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, env=env, check=check
    )


def make_network() -> tuple[str, ipaddress.IPv4Network]:
    """A Docker network on a free /24 of the VPC's CIDR (several agents may run at once)."""
    name = f"physalia-ecs-agent-{os.getpid()}"
    last = ""
    for third in firewall.subnet_order(64, 250):
        net = ipaddress.IPv4Network(f"172.31.{third}.0/24")
        r = docker(
            "network", "create", "--label", LABEL, "--subnet", str(net),
            "--gateway", str(net.network_address + 1), name, check=False,
        )
        if r.returncode == 0:
            return name, net
        last = r.stderr.strip()
    raise SystemExit(f"no free /24 in 172.31.64.0/18 for a Docker network: {last}")


CREDENTIALS_NETWORK = "physalia-ecs-credentials"
CREDENTIALS_IP = "169.254.170.2"


def credentials_network() -> None:
    """The link-local network of ECS's container credentials endpoint, shared by every agent on this
    machine (its address is fixed): internal, its gateway 169.254.170.2 this machine."""
    if docker("network", "inspect", CREDENTIALS_NETWORK, check=False).returncode == 0:
        return
    r = docker(
        "network", "create", "--internal", "--label", "physalia.ecs-agent=shared",
        "--subnet", "169.254.170.0/24", "--gateway", CREDENTIALS_IP, CREDENTIALS_NETWORK, check=False,
    )
    if r.returncode == 0:
        return
    # another agent is making it meanwhile: its create refuses ours ("Pool overlaps") before the
    # network is visible by name, so look for it a while
    for _ in range(50):
        if docker("network", "inspect", CREDENTIALS_NETWORK, check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise SystemExit(f"cannot make the credentials network: {r.stderr.strip()}")


class CredentialsHandler(http.server.BaseHTTPRequestHandler):
    """ECS's task credentials endpoint: moto's test credentials for the task role, an hour long."""

    def do_GET(self) -> None:
        if not self.path.startswith("/v2/credentials/"):
            self.send_error(404)
            return
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        body = json.dumps({
            "AccessKeyId": "testing",
            "SecretAccessKey": "testing",
            "Token": "testing-session",
            "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "RoleArn": f"arn:aws:iam::{ACCOUNT}:role/physalia-coordinator",
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class CredentialsServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # several agents serve the same fixed address at once: any of them answers alike
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class Agent:
    def __init__(self, url: str, cluster: str, network: str, fw: firewall.Firewall):
        kw = dict(endpoint_url=url, region_name=moto_fixture.REGION,
                  aws_access_key_id="testing", aws_secret_access_key="testing")
        self.ecs = boto3.client("ecs", **kw)
        self.ec2 = boto3.client("ec2", **kw)
        self.firewall = fw
        self.sm = boto3.client("secretsmanager", **kw)
        self.logs = boto3.client("logs", **kw)
        self.cluster = cluster
        self.network = network
        self.endpoint = url
        self.runners: dict[str, "TaskRunner"] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def loop(self) -> None:
        while not self.done.is_set():
            try:
                self.tick()
            except Exception as e:  # keep serving; the test sees the consequence
                print(f"ecs agent: {e!r}", file=sys.stderr, flush=True)
            time.sleep(0.2)

    def tick(self) -> None:
        running = self.ecs.list_tasks(cluster=self.cluster, desiredStatus="RUNNING")["taskArns"]
        for arn in running:
            if arn not in self.runners:
                runner = TaskRunner(self, arn)
                self.runners[arn] = runner
                threading.Thread(target=runner.run, daemon=True).start()
        stopped = self.ecs.list_tasks(cluster=self.cluster, desiredStatus="STOPPED")["taskArns"]
        for arn in stopped:
            runner = self.runners.get(arn)
            if runner is not None and not runner.finished:
                runner.stopped_by_api = True
                runner.remove()

    def shutdown(self) -> None:
        self.done.set()
        for runner in list(self.runners.values()):
            runner.stopped_by_api = True
            runner.remove()


class TaskRunner:
    def __init__(self, agent: Agent, arn: str):
        self.agent = agent
        self.arn = arn
        self.id = arn.split("/")[-1]
        self.container = f"ecs-{self.id}"
        self.volume = f"ecs-{self.id}"
        self.finished = False
        self.stopped_by_api = False
        self.pushed = 0
        self.log_group = None
        self.log_stream = None
        self.ip = None

    def run(self) -> None:
        ecs = self.agent.ecs
        task = ecs.describe_tasks(cluster=self.agent.cluster, tasks=[self.arn])["tasks"][0]
        td = ecs.describe_task_definition(taskDefinition=task["taskDefinitionArn"])["taskDefinition"]
        defs = {c["name"]: c for c in td["containerDefinitions"]}
        details = {d["name"]: d["value"] for a in task.get("attachments", []) for d in a.get("details", [])}
        ip = details["privateIPv4Address"]
        self.ip = ip
        # the ENI's security groups decide what reaches the task, from before its first container runs
        eni = self.agent.ec2.describe_network_interfaces(
            NetworkInterfaceIds=[details["networkInterfaceId"]])["NetworkInterfaces"][0]
        groups = [g["GroupId"] for g in eni["Groups"]]
        described = self.agent.ec2.describe_security_groups(GroupIds=groups)["SecurityGroups"] if groups else []
        rules = [r for g in described for r in firewall.sg_rules(g["IpPermissions"], groups)]
        self.agent.firewall.guard(ip, rules)
        # a worker's task, or a cluster-mode coordinator's
        self.main = "worker" if "worker" in defs else "coordinator"
        worker = defs[self.main]
        opts = worker.get("logConfiguration", {}).get("options", {})
        self.log_group = opts.get("awslogs-group")
        self.log_stream = f"{opts.get('awslogs-stream-prefix', 'ecs')}/{self.main}/{self.id}"
        docker("volume", "create", "--label", LABEL, self.volume)
        init = defs.get("secrets")
        if init is not None:
            rc, err = self.run_init(init)
            if rc != 0:
                self.stop_in_moto(1, f"CannotStartContainerError: the secrets container exited {rc}: {err}")
                self.remove()
                return
        if self.stopped_by_api:
            self.remove()
            return
        # labelled with the task definition's container name: a test tells workers from coordinators
        args = ["create", "--name", self.container, "--label", LABEL,
                "--label", f"physalia.ecs-agent.container={self.main}",
                "--network", self.agent.network, "--ip", ip]
        if self.main == "coordinator":
            # what ECS gives a task with a task role, and where this test's AWS is
            args += ["-e", f"AWS_CONTAINER_CREDENTIALS_RELATIVE_URI=/v2/credentials/{self.id}",
                     "-e", f"AWS_REGION={moto_fixture.REGION}",
                     "-e", f"AWS_DEFAULT_REGION={moto_fixture.REGION}",
                     "-e", f"AWS_ENDPOINT_URL={self.agent.endpoint}",
                     "-e", "AWS_ALLOW_HTTP=true"]
        for m in worker.get("mountPoints", []):
            ro = ":ro" if m.get("readOnly") else ""
            args += ["-v", f"{self.volume}:{m['containerPath']}{ro}"]
        for kv in worker.get("environment", []):
            args += ["-e", f"{kv['name']}={kv['value']}"]
        entry = worker.get("entryPoint") or []
        if entry:
            args += ["--entrypoint", entry[0]]
        args.append(worker["image"])
        args += entry[1:] + (worker.get("command") or [])
        r = docker(*args, check=False)
        if r.returncode == 0 and self.main == "coordinator":
            credentials_network()
            r = docker("network", "connect", CREDENTIALS_NETWORK, self.container, check=False)
        if r.returncode == 0:
            r = docker("start", self.container, check=False)
        if r.returncode != 0:
            self.stop_in_moto(1, f"CannotStartContainerError: {r.stderr.strip()}")
            self.remove()
            return
        while True:
            if self.stopped_by_api:
                return
            state = docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}",
                           self.container, check=False)
            if state.returncode != 0:
                return
            running, code = state.stdout.split()
            self.push_logs()
            if running == "false":
                self.stop_in_moto(int(code), "Essential container in task exited")
                self.remove()
                return
            time.sleep(0.5)

    def run_init(self, init: dict) -> tuple[int, str]:
        env = dict(os.environ)
        args = ["run", "--rm", "--label", LABEL, "--network", "none"]
        if init.get("user"):
            args += ["--user", init["user"]]
        for m in init.get("mountPoints", []):
            args += ["-v", f"{self.volume}:{m['containerPath']}"]
        for kv in init.get("environment", []):
            env[kv["name"]] = kv["value"]
            args += ["-e", kv["name"]]
        for s in init.get("secrets", []):
            value = self.agent.sm.get_secret_value(SecretId=s["valueFrom"])["SecretString"]
            # the value reaches the container through docker's environment, not its arguments
            env[s["name"]] = value
            args += ["-e", s["name"]]
        entry = init.get("entryPoint") or []
        if entry:
            args += ["--entrypoint", entry[0]]
        args.append(init["image"])
        args += entry[1:] + (init.get("command") or [])
        r = docker(*args, env=env, check=False)
        return r.returncode, r.stderr.strip()[-500:]

    def push_logs(self) -> None:
        if not self.log_group:
            return
        # both streams through one pipe, in the order the container wrote them
        r = subprocess.run(["docker", "logs", self.container], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, check=False)
        lines = r.stdout.splitlines()
        new = lines[self.pushed:]
        if not new:
            return
        logs = self.agent.logs
        if self.pushed == 0:
            try:
                logs.create_log_stream(logGroupName=self.log_group, logStreamName=self.log_stream)
            except logs.exceptions.ResourceAlreadyExistsException:
                pass
        now = int(time.time() * 1000)
        logs.put_log_events(
            logGroupName=self.log_group,
            logStreamName=self.log_stream,
            logEvents=[{"timestamp": now, "message": line} for line in new],
        )
        self.pushed = len(lines)

    def stop_in_moto(self, exit_code: int, reason: str) -> None:
        """Records the worker's exit as ECS does: the container's exit code, then the task STOPPED."""
        backend = ecs_models.ecs_backends[ACCOUNT][moto_fixture.REGION]
        with self.agent.lock:
            for tasks in backend.tasks.values():
                t = tasks.get(self.arn)
                if t is not None and t.containers:
                    t.containers[0].name = self.main
                    t.containers[0].exitCode = exit_code
                    t.containers[0].last_status = "STOPPED"
        self.agent.ecs.stop_task(cluster=self.agent.cluster, task=self.arn, reason=reason)

    def remove(self) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            self.push_logs()
        except Exception:
            pass
        docker("rm", "-f", self.container, check=False)
        docker("volume", "rm", "-f", self.volume, check=False)
        if self.ip:
            self.agent.firewall.release(self.ip)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--g5-instances", type=int, default=0,
                    help="register N g5.xlarge container instances (a GPU capacity provider's)")
    ap.add_argument("--infra-var", action="append", default=[], metavar="NAME=VALUE",
                    help="a variable of infra/ecs as `terraform apply -var` sets it (mesh_port=7200)")
    ap.add_argument("--region", default=moto_fixture.REGION,
                    help="the region of the cluster, the roles' tasks and the bucket")
    args = ap.parse_args()
    # every module-level use reads it at call time
    moto_fixture.REGION = args.region
    network, subnet = make_network()
    try:
        fw = firewall.Firewall(network, subnet, f"ecs-{os.getpid()}")
    except Exception:
        docker("network", "rm", network, check=False)
        raise
    hosts = subnet.hosts()
    gateway = str(next(hosts))
    credentials_network()
    creds = CredentialsServer((CREDENTIALS_IP, 80), CredentialsHandler)
    threading.Thread(target=creds.serve_forever, daemon=True).start()
    lock = threading.Lock()

    def eni_ip(cidr=None, ipv6=False):
        with lock:
            return str(next(hosts))

    # ENIs of tasks get addresses of the Docker network (moto draws 10.x.y.z at random)
    ecs_models.random_private_ip = eni_ip
    # moto on the Docker network's gateway: this machine and the containers reach it there
    server, out = moto_fixture.start(
        argparse.Namespace(container_instances=0, tasks_stay_running=True, enforce_auth=False,
                           ip=gateway, infra_var=args.infra_var)
    )
    # the job store's bucket
    boto3.client(
        "s3", endpoint_url=out["endpoint"], region_name=moto_fixture.REGION,
        aws_access_key_id="testing", aws_secret_access_key="testing",
    ).create_bucket(Bucket="physalia-jobs", **(
        {} if args.region == "us-east-1"
        else {"CreateBucketConfiguration": {"LocationConstraint": args.region}}))
    out["bucket"] = "physalia-jobs"
    if args.g5_instances:
        kw = dict(endpoint_url=out["endpoint"], region_name=moto_fixture.REGION,
                  aws_access_key_id="testing", aws_secret_access_key="testing")
        ec2, ecs = boto3.client("ec2", **kw), boto3.client("ecs", **kw)
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        for inst in ec2.run_instances(ImageId=ami, MinCount=args.g5_instances,
                                      MaxCount=args.g5_instances, InstanceType="g5.xlarge",
                                      SubnetId=out["subnets"][0])["Instances"]:
            ecs.register_container_instance(
                cluster=out["cluster"],
                instanceIdentityDocument=json.dumps({"instanceId": inst["InstanceId"],
                                                     "region": moto_fixture.REGION,
                                                     "instanceType": "g5.xlarge"}))
        backend = ecs_models.ecs_backends[ACCOUNT][moto_fixture.REGION]
        for ci in backend.container_instances[out["cluster"]].values():
            as_g5_xlarge(ci)
        out["g5_xlarge"] = G5_XLARGE
    agent = Agent(out["endpoint"], out["cluster"], network, fw)
    threading.Thread(target=agent.loop, daemon=True).start()
    out["network"] = network
    out["subnet"] = str(subnet)
    print(json.dumps(out), flush=True)
    try:
        sys.stdin.read()
    finally:
        agent.shutdown()
        creds.shutdown()
        server.stop()
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}", check=False).stdout.split()
        if ids:
            docker("rm", "-f", *ids, check=False)
        vols = docker("volume", "ls", "-q", "--filter", f"label={LABEL}", check=False).stdout.split()
        if vols:
            docker("volume", "rm", "-f", *vols, check=False)
        fw.close()
        docker("network", "rm", network, check=False)


if __name__ == "__main__":
    main()
