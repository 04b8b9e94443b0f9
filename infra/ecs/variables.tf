variable "region" {
  description = "Region of the cluster, the network and every worker (EcsConfig.region)."
  type        = string
  default     = "us-east-1"
}

variable "cluster_name" {
  description = "Name of the ECS cluster the ecs backend runs its tasks in (EcsConfig.cluster)."
  type        = string
  default     = "physalia"
}

variable "vpc_cidr" {
  description = "Address space of the VPC. Each private subnet gets a /20 of a /16 (cidrsubnet(vpc_cidr, 4, i)); the NAT gateway's public subnet is the last /24."
  type        = string
  default     = "10.2.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && contains(["16", "17", "18", "19", "20"], try(split("/", var.vpc_cidr)[1], ""))
    error_message = "vpc_cidr must be an IPv4 block from /16 (the VPC maximum) to /20 (subnets of /24 and a /28 NAT subnet)."
  }
}

variable "availability_zones" {
  description = "Availability zones of the private subnets, or null for the region's first two. GPU instance types are not offered in every zone: name zones that have var.gpu_instance_type if the first two do not."
  type        = list(string)
  default     = null

  validation {
    condition     = var.availability_zones == null ? true : length(var.availability_zones) >= 2
    error_message = "Name at least two availability zones (or none, for the region's first two)."
  }
}

variable "nat_gateway" {
  description = "Create one NAT gateway so the private subnets reach ECR, Secrets Manager, CloudWatch Logs and the ECS endpoints. Without it, add interface VPC endpoints for those services yourself, or nothing can pull an image."
  type        = bool
  default     = true
}

variable "mesh_port" {
  description = "UDP port every worker binds its mesh endpoint on (PHYSALIA_MESH_PORT, WorkerSpec.network). Each awsvpc task has its own ENI, so one port serves every worker."
  type        = number
  default     = 7100
}

variable "coordinator_port" {
  description = "UDP port of the coordinator's control endpoint (the port of PHYSALIA_COORDINATOR_ADDR)."
  type        = number
  default     = 7000
}

variable "gpu_instance_type" {
  description = "Instance type of the GPU Auto Scaling group (infra/catalog/aws-ecs.yaml lists the priced ones)."
  type        = string
  default     = "g5.xlarge"
}

variable "gpu_max_instances" {
  description = "Most GPU instances the capacity provider may scale the group to: the cap on GPU workers running at once (one single-GPU instance per worker)."
  type        = number
  default     = 4

  validation {
    condition     = var.gpu_max_instances >= 1
    error_message = "gpu_max_instances must be at least 1."
  }
}

variable "log_retention_days" {
  description = "Days CloudWatch Logs keeps the workers' (and the coordinator's) output."
  type        = number
  default     = 14
}

variable "dataset_bucket_arn" {
  description = "ARN of an S3 bucket holding datasets (arn:aws:s3:::name), or null. When set, the coordinator role (and the workers' task role) may read it (s3:GetObject, s3:ListBucket); datasets uploaded by `physalia submit` go to the job store instead."
  type        = string
  default     = null
}

variable "coordinator_image" {
  description = "Image of the physalia CLI, to register a Fargate task definition that runs the coordinator in the workers' subnets; null registers none."
  type        = string
  default     = null
}
