"""moto's server on loopback, seeded with what infra/ecs would create, for backends/tests/ecs.

Prints one JSON line (the endpoint, subnets, security group, cluster, log group, execution role, and the
IAM users' keys with --enforce-auth), then serves until its standard input closes.

  --container-instances N   register N EC2 container instances (4096 CPU units, 7482 MiB each)
  --tasks-stay-running      tasks stay RUNNING when described (moto's default advances them one state per
                            DescribeTasks call, towards STOPPED: a task that stops on its own)
  --quota CODE=VALUE        the applied value of a Service Quotas quota (the others answer their default)

What the preflight's usage count reads is answered as ECS does: DescribeTasks gives each task's size
(`cpu`, `memory`), DescribeContainerInstances each instance's registered CPU, `ecs.instance-type` and
running/pending task counts. Not shown (moto has none of it): tasks' `capacityProviderName` (moto ignores
a capacity provider strategy), and the account-wide usage AWS publishes as CloudWatch `AWS/Usage` metrics.
  --capacity-provider NAME  a capacity provider of the cluster (FARGATE, FARGATE_SPOT or an ASG's)
  --infra-var NAME=VALUE    a variable of infra/ecs as `terraform apply -var` sets it (`mesh_port=7200`)

With --enforce-auth, S3's presigned URLs are checked too (presigned.py): the signature of the query's
key for the request, not expired; moto checks only the Authorization header.

The security group's ingress rules are infra/ecs/main.tf's (tests/firewall.py reads them), with the
variables' defaults or --infra-var's values.
  --enforce-auth            after seeding, every request must be signed by a known IAM user: "launcher"
                            may do everything, "no-register" everything but ecs:RegisterTaskDefinition
"""

import argparse
import json
import logging
import os
import sys
import urllib.request

import boto3
import moto.ecs.models as ecs_models
import moto.servicequotas.exceptions as sq_exceptions
import moto.servicequotas.models as sq_models
import moto.servicequotas.responses as sq_responses
from moto.server import ThreadedMotoServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
import firewall  # noqa: E402  (tests/firewall.py: infra's rules)
import presigned  # noqa: E402  (query-string authentication under --enforce-auth)

# ECS's API model has a task's Container.cpu and .memory as strings; moto 5.2 answers numbers, which
# boto3 lets through and strict SDKs (Rust's, Go's) refuse to parse. Answer as ECS does.
_container_init = ecs_models.Container.__init__


def _container_init_as_ecs(self, task_def):
    _container_init(self, task_def)
    self.cpu = None if self.cpu is None else str(self.cpu)
    self.memory = None if self.memory is None else str(self.memory)


ecs_models.Container.__init__ = _container_init_as_ecs

# ECS's DescribeTasks gives a task's size (Task.cpu and .memory, strings, "as expressed in a task
# definition"), which the preflight adds up to count the Fargate vCPUs in use; moto 5.2 leaves both out.
_task_init = ecs_models.Task.__init__


def _task_init_as_ecs(self, cluster, task_definition, *args, **kwargs):
    _task_init(self, cluster, task_definition, *args, **kwargs)
    self.cpu = None if task_definition.cpu is None else str(task_definition.cpu)
    self.memory = None if task_definition.memory is None else str(task_definition.memory)


ecs_models.Task.__init__ = _task_init_as_ecs

REGION = "us-east-1"

# Service Quotas as AWS answers it for the quotas the preflight reads (moto 5.2 knows only VPC's):
# GetServiceQuota answers the applied value of a quota set with --quota CODE=VALUE, and
# NoSuchResourceException for the others, whose value GetAWSDefaultServiceQuota then gives (AWS's
# documented defaults are large; a new account's applied G and VT quota is often 0).
QUOTAS = {
    "L-3032A538": ("fargate", "Fargate On-Demand vCPU resource count", 4000.0),
    "L-36FBB829": ("fargate", "Fargate Spot vCPU resource count", 4000.0),
    "L-1216C47A": ("ec2", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", 5.0),
    "L-DB2E81BA": ("ec2", "Running On-Demand G and VT instances", 64.0),
    "L-417A185B": ("ec2", "Running On-Demand P instances", 384.0),
}
APPLIED: dict = {}


def _quota(service_code: str, quota_code: str, value: float) -> dict:
    service, name, _ = QUOTAS[quota_code]
    return {
        "ServiceCode": service,
        "ServiceName": {"ec2": "Amazon Elastic Compute Cloud (Amazon EC2)",
                        "fargate": "AWS Fargate"}[service],
        "QuotaArn": f"arn:aws:servicequotas:{REGION}:123456789012:{service}/{quota_code}",
        "QuotaCode": quota_code,
        "QuotaName": name,
        "Value": value,
        "Unit": "None",
        "Adjustable": True,
        "GlobalQuota": False,
    }


def _known(service_code: str, quota_code: str) -> bool:
    return quota_code in QUOTAS and QUOTAS[quota_code][0] == service_code


_get_service_quota = sq_models.ServiceQuotasBackend.get_service_quota


def _get_service_quota_as_aws(self, service_code: str, quota_code: str) -> dict:
    if _known(service_code, quota_code):
        if quota_code in APPLIED:
            return _quota(service_code, quota_code, APPLIED[quota_code])
        raise sq_exceptions.NoSuchResource()
    return _get_service_quota(self, service_code, quota_code)


def _get_aws_default_service_quota(self) -> str:
    params = json.loads(self.body)
    service_code, quota_code = str(params.get("ServiceCode")), str(params.get("QuotaCode"))
    if not _known(service_code, quota_code):
        raise sq_exceptions.NoSuchResource()
    return json.dumps({"Quota": _quota(service_code, quota_code, QUOTAS[quota_code][2])})


sq_models.ServiceQuotasBackend.get_service_quota = _get_service_quota_as_aws
sq_responses.ServiceQuotasResponse.get_aws_default_service_quota = _get_aws_default_service_quota


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--container-instances", type=int, default=0)
    ap.add_argument("--tasks-stay-running", action="store_true")
    ap.add_argument("--enforce-auth", action="store_true")
    ap.add_argument("--quota", action="append", default=[], metavar="CODE=VALUE")
    ap.add_argument("--capacity-provider", action="append", default=[], metavar="NAME")
    ap.add_argument("--infra-var", action="append", default=[], metavar="NAME=VALUE")
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
    infra_vars = dict(v.split("=", 1) for v in getattr(args, "infra_var", None) or [])
    permissions = firewall.ecs_ingress(infra_vars)
    for p in permissions:
        for pair in p.get("UserIdGroupPairs", []):
            pair["GroupId"] = sg
    ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=permissions)
    for q in getattr(args, "quota", None) or []:
        code, value = q.split("=")
        APPLIED[code] = float(value)
    providers = getattr(args, "capacity_provider", None) or []
    for name in providers:
        if name not in ("FARGATE", "FARGATE_SPOT"):
            ecs.create_capacity_provider(
                name=name,
                autoScalingGroupProvider={
                    "autoScalingGroupArn": f"arn:aws:autoscaling:{REGION}:123456789012:"
                    f"autoScalingGroup:0:autoScalingGroupName/{name}",
                    "managedScaling": {"status": "ENABLED", "targetCapacity": 100},
                },
            )
    if providers:
        ecs.create_cluster(clusterName="physalia", capacityProviders=providers)
    else:
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
        # S3's presigned URLs are checked as S3 checks them (moto checks only the header)
        presigned.install()
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
