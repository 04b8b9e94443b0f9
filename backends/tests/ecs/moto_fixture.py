"""moto's server on loopback, seeded with what infra/ecs would create, for backends/tests/ecs.

Prints one JSON line (the endpoint, subnets, security group, cluster, log group, execution role, and the
IAM users' keys with --enforce-auth), then serves until its standard input closes.

  --container-instances N   register N EC2 container instances (4096 CPU units, 7482 MiB each)
  --tasks-stay-running      tasks stay RUNNING when described (moto's default advances them one state per
                            DescribeTasks call, towards STOPPED: a task that stops on its own)
  --enforce-auth            after seeding, every request must be signed by a known IAM user: "launcher"
                            may do everything, "no-register" everything but ecs:RegisterTaskDefinition
"""

import argparse
import json
import logging
import sys
import urllib.request

import boto3
import moto.ecs.models as ecs_models
from moto.server import ThreadedMotoServer

# ECS's API model has a task's Container.cpu and .memory as strings; moto 5.2 answers numbers, which
# boto3 lets through and strict SDKs (Rust's, Go's) refuse to parse. Answer as ECS does.
_container_init = ecs_models.Container.__init__


def _container_init_as_ecs(self, task_def):
    _container_init(self, task_def)
    self.cpu = None if self.cpu is None else str(self.cpu)
    self.memory = None if self.memory is None else str(self.memory)


ecs_models.Container.__init__ = _container_init_as_ecs

REGION = "us-east-1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--container-instances", type=int, default=0)
    ap.add_argument("--tasks-stay-running", action="store_true")
    ap.add_argument("--enforce-auth", action="store_true")
    server, out = start(ap.parse_args())
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    server.stop()


def start(args: argparse.Namespace) -> tuple[ThreadedMotoServer, dict]:
    """Starts and seeds the server (tests/ecs/ecs_agent.py drives it in-process); returns it and what
    main() prints."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    # loopback, or (tests/ecs/ecs_agent.py) the gateway of a Docker network, where containers reach it
    ip = getattr(args, "ip", None) or "127.0.0.1"
    server = ThreadedMotoServer(ip_address=ip, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"

    def client(name: str, key: str = "testing", secret: str = "testing"):
        return boto3.client(
            name,
            endpoint_url=url,
            region_name=REGION,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )

    ec2, ecs, logs, iam = client("ec2"), client("ecs"), client("logs"), client("iam")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    subnets = sorted(
        s["SubnetId"]
        for s in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]
    )[:2]
    sg = ec2.create_security_group(
        GroupName="physalia-workers", Description="QUIC among workers", VpcId=vpc
    )["GroupId"]
    ecs.create_cluster(clusterName="physalia")
    if args.container_instances:
        ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        instances = ec2.run_instances(
            ImageId=ami,
            MinCount=args.container_instances,
            MaxCount=args.container_instances,
            InstanceType="g5.xlarge",
            SubnetId=subnets[0],
        )["Instances"]
        for inst in instances:
            ecs.register_container_instance(
                cluster="physalia",
                instanceIdentityDocument=json.dumps(
                    {"instanceId": inst["InstanceId"], "region": REGION,
                     "instanceType": "g5.xlarge"}
                ),
            )
    logs.create_log_group(logGroupName="/physalia/workers")
    trust = json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Service": "ecs-tasks.amazonaws.com"},
                    "Action": "sts:AssumeRole",
                }
            ],
        }
    )
    role = iam.create_role(RoleName="physalia-worker-execution", AssumeRolePolicyDocument=trust)
    coordinator = iam.create_role(RoleName="physalia-coordinator", AssumeRolePolicyDocument=trust)
    out = {
        "endpoint": url,
        "region": REGION,
        "cluster": "physalia",
        "subnets": subnets,
        "security_groups": [sg],
        "log_group": "/physalia/workers",
        "execution_role_arn": role["Role"]["Arn"],
        "coordinator_task_role_arn": coordinator["Role"]["Arn"],
        "users": {},
    }

    if args.tasks_stay_running:
        post(url, "/moto-api/state-manager/set-transition",
             json.dumps({"model_name": "ecs::task",
                         "transition": {"progression": "manual", "times": 10**9}}))

    if args.enforce_auth:
        policies = {
            "launcher": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
            "no-register": [
                {"Effect": "Allow", "Action": "*", "Resource": "*"},
                {"Effect": "Deny", "Action": "ecs:RegisterTaskDefinition", "Resource": "*"},
            ],
        }
        for user, statements in policies.items():
            iam.create_user(UserName=user)
            iam.put_user_policy(
                UserName=user,
                PolicyName="physalia",
                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": statements}),
            )
            key = iam.create_access_key(UserName=user)["AccessKey"]
            out["users"][user] = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        # from now on every request is authenticated and authorized
        post(url, "/moto-api/reset-auth", "0")

    return server, out


def post(url: str, path: str, body: str) -> None:
    req = urllib.request.Request(
        url + path, data=body.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(req).read()


if __name__ == "__main__":
    main()
