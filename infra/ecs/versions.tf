terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.0"
    }
  }
}

provider "aws" {
  region = var.region

  # On every resource this module creates (not on what the backend creates at run time: its task
  # definitions, tasks and secrets carry their own physalia.dev/launch tag).
  default_tags {
    tags = {
      "physalia.dev/infra" = "ecs"
    }
  }
}
